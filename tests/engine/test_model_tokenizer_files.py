"""The tokenizer.json path of the HF loader: a folder whose tokenizer files transformers wrote
(from the bundled GGUF's vocabulary) must encode, decode and render chats like transformers."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine_native.model.bundled import bundled_model_path
from engine_native.model.errors import ModelLoadError
from engine_native.model.loader import load_model
from engine_native.model.tokenizer_loader import load_tokenizer

TEXTS = ["Hello world", "  x = 12345\n\tdef f(): pass", "日本語 😀", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def hf_folder_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_tok")
    gguf_dir = tmp_path_factory.mktemp("gguf")
    (gguf_dir / "m.gguf").symlink_to(bundled_model_path())
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="m.gguf")
    tok.save_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=[2, 0],
    )
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def test_hf_folder_tokenizer_matches_transformers(hf_folder_with_tokenizer: Path) -> None:
    ours = load_model(str(hf_folder_with_tokenizer), dtype=torch.float32, progress=False)
    ref = AutoTokenizer.from_pretrained(str(hf_folder_with_tokenizer))
    tok = ours.tokenizer
    assert tok is not None
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert {0, 2} <= set(tok.eos_token_ids)  # config/generation_config eos ids plus end-of-turn tokens


def test_bos_is_added_once(hf_folder_with_tokenizer: Path, tmp_path: Path) -> None:
    # Same folder, but the tokenizer config asks for BOS (<|im_start|> plays BOS here).
    for name in os.listdir(hf_folder_with_tokenizer):
        (tmp_path / name).symlink_to(hf_folder_with_tokenizer / name)
    (tmp_path / "tokenizer_config.json").unlink()
    tcfg = json.loads((hf_folder_with_tokenizer / "tokenizer_config.json").read_text())
    tcfg.update(add_bos_token=True, bos_token="<|im_start|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tok = load_model(str(tmp_path), dtype=torch.float32, progress=False).tokenizer
    assert tok is not None and tok.add_bos_token
    assert tok.encode("hi")[0] == 1
    assert tok.encode("<|im_start|>user")[:2] != [1, 1]
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


def test_the_tokenizer_alone_reads_the_folder_as_the_model_load_does(hf_folder_with_tokenizer: Path) -> None:
    alone = load_tokenizer(str(hf_folder_with_tokenizer))
    loaded = load_model(str(hf_folder_with_tokenizer), dtype=torch.float32, progress=False).tokenizer
    assert alone is not None and loaded is not None
    assert alone.eos_token_ids == loaded.eos_token_ids == [2, 0]  # the config.json's eos_token_id list
    assert [alone.encode(t) for t in TEXTS] == [loaded.encode(t) for t in TEXTS]


@pytest.mark.parametrize("config", ["{not json", "[1, 2]"])
def test_a_broken_config_json_is_a_load_error_for_the_tokenizer_too(
    hf_folder_with_tokenizer: Path, tmp_path: Path, config: str
) -> None:
    for name in os.listdir(hf_folder_with_tokenizer):
        if name != "config.json":
            (tmp_path / name).symlink_to(hf_folder_with_tokenizer / name)
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_tokenizer(str(tmp_path))
