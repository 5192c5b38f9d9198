"""benchmarks/random_model.py: the tokenizer a GPU machine gets instead of the 98 MB GGUF file must be the
bundled model's, or the served benchmark there builds other prompts than here."""

from __future__ import annotations

from pathlib import Path

from benchmarks.random_model import export_tokenizer
from engine_native.model.bundled import bundled_model_path
from engine_native.model.hf_tokenizer import load_hf_tokenizer
from engine_native.model.tokenizer_loader import load_tokenizer

TEXTS = ["Hello, world!", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "naïve café — 日本語 🙂", "  spaces\t\ttabs\n\n"]


def test_the_exported_tokenizer_is_the_bundled_models(tmp_path: Path) -> None:
    export_tokenizer(bundled_model_path(), tmp_path)
    exported, bundled = load_hf_tokenizer(str(tmp_path)), load_tokenizer(bundled_model_path())
    assert exported is not None and bundled is not None
    for text in TEXTS:
        ids = bundled.encode(text)
        assert exported.encode(text) == ids
        assert exported.decode(ids) == bundled.decode(ids)
    assert exported.eos_token_ids == bundled.eos_token_ids
    assert (exported.bos_token_id, exported.add_bos_token) == (bundled.bos_token_id, bundled.add_bos_token)
    assert exported.chat_template == bundled.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert exported.apply_chat_template(messages) == bundled.apply_chat_template(messages)
