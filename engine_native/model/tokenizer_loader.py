"""Only the tokenizer of a model path, no weights: for the process that tokenizes prompts (the gateway's
native driver), which imports no torch for it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine_native.model.errors import ModelNotFoundError
from engine_native.model.gguf_config import open_gguf
from engine_native.model.gguf_tokenizer import tokenizer_from_gguf
from engine_native.model.hf_tokenizer import load_hf_tokenizer
from engine_native.model.tokenizer import Tokenizer


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
