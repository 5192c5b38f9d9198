"""A tiny random Llama saved as a Hugging Face folder, for engine tests that need a real model but not
a good one (no tests here)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from engine_native.model.base import LoadedModel
from engine_native.model.loader import load_model


def save_tiny_llama(path: Path, seed: int = 0, vocab_size: int = 256) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(path)


def load_tiny_llama(path: Path) -> LoadedModel:
    if not (path / "config.json").exists():
        save_tiny_llama(path)
    return load_model(str(path), dtype=torch.float32, progress=False)


def prompt(n: int, seed: int, vocab_size: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()
