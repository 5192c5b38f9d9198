"""The bundled GGUF's tensors as the kernels' blocks beside gguf-py's dense dequantization, for the block-kernel
tests."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from engine_native.model.bundled import bundled_model_path
from engine_native.model.gguf_file import read_gguf
from engine_native.model.quant import Q41Weight, Q80Weight, q4_1_from_gguf, q8_0_from_gguf


def bundled_blocks(names: Iterable[str]) -> dict[str, tuple[Q41Weight | Q80Weight, torch.Tensor]]:
    """name -> (its Q4_1 or Q8_0 blocks, the same weight dequantized to fp32 by gguf-py)."""
    wanted = set(names)
    out: dict[str, tuple[Q41Weight | Q80Weight, torch.Tensor]] = {}
    for t in read_gguf(bundled_model_path()).tensors:
        if t.name in wanted:
            blocks = q4_1_from_gguf(t.data) if t.tensor_type.name == "Q4_1" else q8_0_from_gguf(t.data)
            dense = torch.from_numpy(np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
            out[t.name] = (blocks, dense)
    return out
