"""What a model path holds, read from its headers only: architecture, size, memory it will take.

Deploying a model version checks this before loading anything (a missing file, an architecture no
loader implements, or a model too big for the memory budget is refused up front), so it must be cheap:
a GGUF file's metadata and tensor table, a folder's config.json and the JSON headers of its
safetensors files. No weight is read.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass
from math import prod

from engine_native.config import ModelConfig
from engine_native.model.errors import ModelLoadError, ModelNotFoundError
from engine_native.model.gguf_config import open_gguf
from engine_native.model.hf_config import config_from_hf, read_json_object
from engine_native.precision import ELEMENT_BYTES, dtype_name

_SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024  # the format's own bound on a header


@dataclass(frozen=True)
class ModelSummary:
    config: ModelConfig
    parameters: int
    weight_bytes: int
    """Memory one engine's copy of the weights takes: the dense weights in the compute dtype, plus,
    for GGUF, the quantized blocks kept for small decode steps (about the file's size)."""

    @property
    def architecture(self) -> str:
        return self.config.architecture


def inspect_model(path: str, dtype: str = "auto") -> ModelSummary:
    """Raises ModelNotFoundError (nothing at `path`), UnsupportedArchitectureError, or ModelLoadError."""
    elem = ELEMENT_BYTES[dtype_name(dtype)]
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        gguf = open_gguf(path)  # the loaders' own reading of the header: its errors and its config
        params = sum(t.n_elements for t in gguf.tensors)
        return ModelSummary(gguf.config, params, params * elem + os.path.getsize(path))
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(f"{path} has no config.json")
        config = config_from_hf(read_json_object(config_path), os.path.basename(os.path.normpath(path)))
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ModelLoadError(f"{path} has config.json but no *.safetensors weights")
        params = sum(_safetensors_parameters(f) for f in files)
        return ModelSummary(config, params, params * elem)
    if os.path.exists(path):
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model folder")
    raise ModelNotFoundError(f"model path not found: {path}")


def _safetensors_parameters(path: str) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _SAFETENSORS_HEADER_MAX:
                raise ModelLoadError(f"{path}: safetensors header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path} as safetensors: {exc}") from exc
    return sum(prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
