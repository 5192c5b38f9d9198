"""`load_model`: the one entry point from a path to a `LoadedModel`.

A path ending in .gguf goes to the GGUF loader; a folder with config.json and
safetensors goes to the Hugging Face loader. Everything else is a ModelLoadError
that says what was found there.
"""

from __future__ import annotations

import os

import torch

from engine_native.model.base import LoadedModel
from engine_native.model.errors import ModelLoadError, ModelNotFoundError
from engine_native.model.gguf_loader import load_gguf
from engine_native.model.hf_loader import load_hf_folder


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
