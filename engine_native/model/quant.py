"""Weights kept in their GGUF block formats, for steps of a few tokens (see kernels/quant_linear.cpp).

A model loaded from a GGUF file keeps, beside its dense weights, the Q4_1 and Q8_0 blocks it was
quantized to. A step of at most `EngineConfig.quantized_max_rows` tokens multiplies by the blocks
(reading 4-8x fewer bytes than fp32); a bigger step uses the dense GEMM, which is faster once the
step is compute-bound. Both paths use the same fp32 weight values (the kernel dequantizes in
registers exactly as gguf does at load), so a request's output does not depend on which path its
step took beyond the order of additions. With bf16 dense weights on a CPU with AMX-BF16, pure-decode
steps of up to `EngineConfig.amx_max_rows` sequences multiply by the Q4_1 blocks through AMX (`amx_linear`), which
dequantizes them to the dense path's very bf16 values and rounds its output as the dense GEMM does.

    Q4_1 block of 32 weights: fp16 d, fp16 m, 16 bytes of nibbles -> w = d * q + m, q in 0..15
    Q8_0 block of 32 weights: fp16 d, 32 int8                     -> w = d * q

Layouts here (row n of the weight is output feature n):
    Q41Weight.qs [N, K/32, 16] uint8 (byte j: element j low nibble, element j + 16 high), dm [N, K/32, 2] fp32
    Q80Weight.qs [N, K/32, 32] int8, d [N, K/32] fp32
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from engine_native.kernels import cpu_kernels as _kernels

BLOCK = 32


@dataclass(frozen=True)
class Q41Weight:
    qs: torch.Tensor
    dm: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * BLOCK

    def rows(self, index: torch.Tensor) -> Q41Weight:
        return Q41Weight(self.qs[index].contiguous(), self.dm[index].contiguous())


@dataclass(frozen=True)
class Q80Weight:
    qs: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * BLOCK

    def rows(self, index: torch.Tensor) -> Q80Weight:
        return Q80Weight(self.qs[index].contiguous(), self.d[index].contiguous())


QuantWeight = Q41Weight | Q80Weight


def q4_1_from_gguf(raw: np.ndarray) -> Q41Weight:
    """GGUF Q4_1 tensor data, uint8 [N, K/32 * 20] -> Q41Weight."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = np.ascontiguousarray(blocks[..., 4:20])
    dm = np.concatenate([d, m], axis=-1)
    return Q41Weight(torch.from_numpy(qs.copy()), torch.from_numpy(np.ascontiguousarray(dm)))


def q8_0_from_gguf(raw: np.ndarray) -> Q80Weight:
    """GGUF Q8_0 tensor data, uint8 [N, K/32 * 34] -> Q80Weight."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    qs = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    return Q80Weight(torch.from_numpy(qs.copy()), torch.from_numpy(np.ascontiguousarray(d)))


def concat(parts: Sequence[QuantWeight | None]) -> QuantWeight | None:
    """Stack weights along N (q/k/v into qkv, gate/up into gate_up); None unless all share one format."""
    if not parts or any(p is None for p in parts):
        return None
    if all(isinstance(p, Q41Weight) for p in parts):
        q41 = [p for p in parts if isinstance(p, Q41Weight)]
        return Q41Weight(torch.cat([p.qs for p in q41]), torch.cat([p.dm for p in q41]))
    if all(isinstance(p, Q80Weight) for p in parts):
        q80 = [p for p in parts if isinstance(p, Q80Weight)]
        return Q80Weight(torch.cat([p.qs for p in q80]), torch.cat([p.d for p in q80]))
    return None


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The fp32 [N, K] weight, computed as gguf computes it (the reference of the kernel tests)."""
    n, k = w.shape
    if isinstance(w, Q41Weight):
        lo = (w.qs & 0x0F).float()
        hi = (w.qs >> 4).float()
        q = torch.cat([lo, hi], dim=-1)  # [N, K/32, 32]
        return (w.dm[..., 0:1] * q + w.dm[..., 1:2]).reshape(n, k)
    return (w.qs.float() * w.d.unsqueeze(-1)).reshape(n, k)


def kernels_available() -> bool:
    return _kernels() is not None


def amx_available() -> bool:
    """Whether `amx_linear` runs here: the kernels built for a CPU with AMX-BF16, the OS granting it."""
    kernels = _kernels()
    return kernels is not None and bool(kernels.amx_q4_1_available())


def amx_fits(w: QuantWeight) -> bool:
    return isinstance(w, Q41Weight) and w.shape[0] % 32 == 0


@dataclass(frozen=True)
class PanelWeight:
    """A Q4_1 or Q8_0 weight re-laid out for kernels/quant_panel.cpp: per 16 weight rows and block, the 16
    rows' values element by element (that file's header gives the layouts). The same codes and scales."""

    qs: torch.Tensor
    scales: torch.Tensor  # Q4_1: [N/16, K/32, 2, 16] (d then m); Q8_0: [N/16, K/32, 16]
    q4_1: bool


def panel_fits(w: QuantWeight) -> bool:
    return w.shape[0] % 32 == 0


def panel_blocks(w: QuantWeight) -> PanelWeight:
    """`w` in the panel kernels' layout; needs `panel_fits(w)`."""
    n, k = w.shape
    g = n // 16
    if isinstance(w, Q41Weight):
        codes = torch.cat([w.qs & 0x0F, w.qs >> 4], dim=-1)  # [N, K/32, 32], element order
        codes = codes.reshape(g, 16, k // BLOCK, BLOCK).permute(0, 2, 3, 1)  # [G, K/32, 32, 16 rows]
        qs = (codes[..., :8] | (codes[..., 8:] << 4)).contiguous()
        scales = w.dm.reshape(g, 16, k // BLOCK, 2).permute(0, 2, 3, 1).contiguous()
        return PanelWeight(qs, scales, q4_1=True)
    qs = w.qs.reshape(g, 16, k // BLOCK, BLOCK).permute(0, 2, 3, 1).contiguous()
    scales = w.d.reshape(g, 16, k // BLOCK).permute(0, 2, 1).contiguous()
    return PanelWeight(qs, scales, q4_1=False)


def panel_linear(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) @ w^T -> [M, N] fp32; needs `kernels_available()` (the panel kernels build
    wherever Sluice's kernels do: AVX2, and AVX-512 where the CPU has it)."""
    kernels = _kernels()
    assert kernels is not None
    xf = x.float().contiguous()
    y = (kernels.q4_1_panel_linear if w.q4_1 else kernels.q8_0_panel_linear)(xf, w.qs, w.scales)
    return y if bias is None else y + bias


def amx_linear(x: torch.Tensor, w: Q41Weight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] bf16 through AMX (kernels/amx_linear.cpp), rounded as the dense bf16
    GEMM rounds its output; x is rounded to bf16 first, as for the dense GEMM. Needs `amx_available()`
    and `amx_fits(w)`."""
    kernels = _kernels()
    assert kernels is not None
    return kernels.amx_q4_1_linear(x.to(torch.bfloat16).contiguous(), w.qs, w.dm, True)


class Activations(IntEnum):
    """How a block product takes its activations (kernels/quant_rounded.cpp; the kernels' values): as they are, or
    each row rounded to integer blocks of 32, one scale a block, first."""

    FP32 = 0
    INT16 = 1  # 65,535 steps of the block's largest magnitude: half a step is 1.5e-5 of it
    INT8 = 2  # 255 steps: 8-bit activations' accuracy


@dataclass(frozen=True)
class ActivationRounding:
    """Which steps of the block products round their activations: steps of at most `int8_max_rows` tokens to int8
    blocks, else of at most `int16_max_rows` to int16 blocks, the rest not at all."""

    int16_max_rows: int = 0
    int8_max_rows: int = 0

    def for_rows(self, rows: int) -> Activations:
        if rows <= self.int8_max_rows:
            return Activations.INT8
        if rows <= self.int16_max_rows:
            return Activations.INT16
        return Activations.FP32

    def within(self, max_rows: int) -> ActivationRounding:
        """The same for steps the blocks take (at most `max_rows` tokens)."""
        return ActivationRounding(min(self.int16_max_rows, max_rows), min(self.int8_max_rows, max_rows))


NO_ROUNDING = ActivationRounding()  # every block product in fp32

# Steps of at most this many tokens round their activations to int16 blocks by default where that pays
# (int16_activations_pay). In-process on a 2-core AVX2-only EPYC (Zen 3), the bundled model's block products
# int16 against fp32: 1.18-2.08x at 1 row, 1.16-1.67x at 2, 0.92-1.27x at 3 (docs/engine.md).
INT16_ACTIVATION_MAX_ROWS = 2


def int16_activations_pay() -> bool:
    """Whether int16 activations make the block products faster here: measured so where the kernels decode a block
    on 8 lanes (no AVX-512); on AVX-512 the fp32 products decode on 16 and were not measured against them."""
    kernels = _kernels()
    return kernels is not None and not bool(getattr(kernels, "BLOCKS_ON_16_LANES", True))


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 activations: Activations = Activations.FP32) -> torch.Tensor:
    """x [M, K] (any float dtype) @ w^T -> [M, N] in x's dtype; needs `kernels_available()`. With INT16 or INT8
    `activations` each row of x is rounded to integer blocks of 32 first (kernels/quant_rounded.cpp)."""
    kernels = _kernels()
    assert kernels is not None
    xf = x.float().contiguous()
    if isinstance(w, Q41Weight):
        y = kernels.q4_1_linear(xf, w.qs, w.dm, int(activations))
    else:
        y = kernels.q8_0_linear(xf, w.qs, w.d, int(activations))
    if bias is not None:
        y = y + bias
    return y if x.dtype == torch.float32 else y.to(x.dtype)
