"""Hugging Face transformers' own model of the bundled GGUF (its GGUF integration reads and dequantizes the file
with gguf-py): the reference the engine tests hold Sluice's outputs to.

Loading it takes ~15 s on these hosts (transformers converts the whole file, vocabulary included, on every
load), and five test files need it (seven loads a run before), so each dtype is loaded once per test process
and shared. The tests only run it (eval mode, no gradients) and never change it."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from engine_native.model.bundled import bundled_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.cache
def hf_bundled(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    path = Path(bundled_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()
