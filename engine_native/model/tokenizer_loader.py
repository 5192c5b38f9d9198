"""Only the tokenizer of a model path, no weights: for the process that tokenizes prompts (the gateway's
native driver), which imports no torch for it.
"""

from __future__ import annotations

import os

from engine_native.model.errors import ModelNotFoundError
from engine_native.model.gguf_config import open_gguf
from engine_native.model.gguf_tokenizer import tokenizer_from_gguf
from engine_native.model.hf_config import read_json_object
from engine_native.model.hf_tokenizer import load_hf_tokenizer
from engine_native.model.tokenizer import Tokenizer


def load_tokenizer(path: str) -> Tokenizer | None:
    """Only the tokenizer of a model path (no weights): for the process that tokenizes prompts."""
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return tokenizer_from_gguf(open_gguf(path).meta)
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        return load_hf_tokenizer(path, read_json_object(config_path) if os.path.isfile(config_path) else None)
    raise ModelNotFoundError(f"model path not found: {path}")
