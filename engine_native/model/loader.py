"""`load_model`: the one entry point from a path to a `LoadedModel`.

A path ending in .gguf goes to the GGUF loader; a folder with config.json and
safetensors goes to the Hugging Face loader. Everything else is a ModelLoadError
that says what was found there.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from engine_native.model.base import LoadedModel, ModelLoadError, ModelNotFoundError, Tokenizer
from engine_native.model.gguf_loader import load_gguf, open_gguf
from engine_native.model.gguf_tokenizer import tokenizer_from_gguf
from engine_native.model.hf_loader import load_hf_folder, load_hf_tokenizer


def load_model(path: str, dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> LoadedModel:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"unsupported dtype {dtype}; use torch.float32 or torch.bfloat16")
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return load_gguf(path, dtype, progress)
    if os.path.isdir(path):
        return load_hf_folder(path, dtype, progress)
    if os.path.exists(path):
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model folder")
    raise ModelNotFoundError(f"model path not found: {path}")


def load_tokenizer(path: str) -> Tokenizer | None:
    """Only the tokenizer of a model path (no weights): for the process that tokenizes prompts."""
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return tokenizer_from_gguf(open_gguf(path).meta)
    if os.path.isdir(path):
        return load_hf_tokenizer(path, _read_json_if_exists(os.path.join(path, "config.json")))
    raise ModelNotFoundError(f"model path not found: {path}")


def _read_json_if_exists(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None
