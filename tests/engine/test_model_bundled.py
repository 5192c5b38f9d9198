"""The bundled SmolLM2-135M Q4_1 GGUF against transformers loading the very same file
(transformers dequantizes the same Q4_1 blocks and un-permutes q/k the same way)."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_bundled import hf_bundled
from test_model_support import PagedSequences

from engine_native.model.base import LoadedModel
from engine_native.model.bundled import bundled_model_path
from engine_native.model.loader import load_model

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 1234567890 + 3.14159 = ?",
    "  leading spaces\n\n\ttabs\r\nand CRLF   trailing   ",
    "emoji 😀🎉👩‍👩‍👧 and CJK 日本語のテキスト 中文 한국어",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "I've been here, you'll see; they're DONE. naïve café façade",
    "",
]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smol")
    (folder / "model.gguf").symlink_to(bundled_model_path())
    return folder


@pytest.fixture(scope="module")
def smol_ours() -> LoadedModel:
    return load_model(bundled_model_path(), dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def smol_hf_tokenizer(smol_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir), gguf_file="model.gguf")


@pytest.fixture(scope="module")
def smol_hf_model() -> Any:
    return hf_bundled(torch.float32)


def test_config_from_metadata(smol_ours: LoadedModel) -> None:
    c = smol_ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.vocab_size == 49152 and c.rope_theta == 100000.0


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_equal_transformers(smol_ours: LoadedModel, smol_hf_tokenizer: Any, text: str) -> None:
    tok = smol_ours.tokenizer
    assert tok is not None
    assert tok.encode(text) == smol_hf_tokenizer.encode(text)
    assert tok.encode(text, add_special_tokens=False) == smol_hf_tokenizer.encode(
        text, add_special_tokens=False
    )
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == smol_hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_stop_ids(smol_ours: LoadedModel) -> None:
    tok = smol_ours.tokenizer
    assert tok is not None
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.id_to_token(2) == "<|im_end|>"
    assert 2 in tok.eos_token_ids and 0 in tok.eos_token_ids  # <|im_end|>, <|endoftext|>
    assert tok.bos_token_id == 1 and tok.add_bos_token is False  # like transformers for this file


def test_chat_template_renders_like_transformers(smol_ours: LoadedModel, smol_hf_tokenizer: Any) -> None:
    tok = smol_ours.tokenizer
    assert tok is not None
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ):
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            ref = smol_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == ref
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_logits_match_transformers_on_the_same_gguf(smol_ours: LoadedModel, smol_hf_model: Any) -> None:
    tok = smol_ours.tokenizer
    assert tok is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about paged attention."}])
    ids = tok.encode(prompt)
    with torch.no_grad():
        ref = smol_hf_model(torch.tensor([ids])).logits[0].float()
    seqs = PagedSequences(smol_ours.config, num_blocks=16, block_size=16, dtype=torch.float32, seed=1)
    half = len(ids) // 2  # two chunks, so the second attends to cached context
    first = smol_ours.model.forward(seqs.step([(0, ids[:half])]), seqs.cache)
    second = smol_ours.model.forward(seqs.step([(0, ids[half:])]), seqs.cache)
    ours = torch.cat([first, second])
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
