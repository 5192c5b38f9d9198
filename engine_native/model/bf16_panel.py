"""The dense bf16 weights laid out once for kernels/bf16_panel.cpp, and the product through it.

On a CPU with AVX-512 BF16 and no AMX, a pure-decode step of 9 to a few hundred sequences multiplies by
these panels instead of oneDNN's packed weights: the same bf16 weights and inputs, products added in fp32,
only the order of the additions differs (the kernel's header says why it is faster). Prompts stay on
oneDNN, so a prompt's first token does not depend on which kernel a step of its size would get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_native.kernels import cpu_kernels

PANEL_COLUMNS = 48  # output columns (weight rows) per panel: kernels/bf16_panel.cpp kPanelCols
# The panels are a second copy of the dense weights: never more than this share of the memory available when
# they would be made, so that a model that fits once still gets its KV pool (sizing.py takes up to 25% of what
# is left) and a big model keeps oneDNN alone instead of running out of memory.
MAX_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class Bf16Panel:
    """A bf16 [N, K] weight as [ceil(N/48), K/2, 48, 2]: per 48 weight rows and k-pair, the rows' two values
    in turn; the rows past N are zeros."""

    data: torch.Tensor
    out_features: int


def bf16_panel_available() -> bool:
    """Whether `bf16_panel_linear` runs here: the kernels built for a CPU with AVX-512 BF16."""
    kernels = cpu_kernels()
    return kernels is not None and bool(kernels.bf16_panel_available())


def bf16_panel_fits(weight: torch.Tensor) -> bool:
    """A bf16 [N, K] weight with K even (the kernel reads pairs)."""
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.shape[0] > 0 and weight.shape[1] % 2 == 0


def panels_fit_in_memory(weights: list[torch.Tensor], available_bytes: int) -> bool:
    """Whether panels of these weights (padded to whole panels) take at most MAX_MEMORY_FRACTION of
    `available_bytes`."""
    padded = sum(-(-w.shape[0] // PANEL_COLUMNS) * PANEL_COLUMNS * w.shape[1] * w.element_size() for w in weights)
    return padded <= available_bytes * MAX_MEMORY_FRACTION


def to_bf16_panel(weight: torch.Tensor) -> Bf16Panel:
    """Lay a bf16 [N, K] weight (`bf16_panel_fits`) out as its panels, once at load."""
    n, k = weight.shape
    full, rest = divmod(n, PANEL_COLUMNS)
    data = torch.empty(full + bool(rest), k // 2, PANEL_COLUMNS, 2, dtype=weight.dtype)
    # Straight into the panels, not through a padded copy of the whole weight: the layout writes half the
    # memory it did (fresh pages cost ~1 GB/s on some VMs' first touch).
    data[:full].copy_(weight[: full * PANEL_COLUMNS].view(full, PANEL_COLUMNS, k // 2, 2).permute(0, 2, 1, 3))
    if rest:
        last = F.pad(weight[full * PANEL_COLUMNS :], (0, 0, 0, PANEL_COLUMNS - rest))
        data[full:].copy_(last.view(1, PANEL_COLUMNS, k // 2, 2).permute(0, 2, 1, 3))
    return Bf16Panel(data, n)


def bf16_panel_linear(
    x: torch.Tensor, panel: Bf16Panel, bias: torch.Tensor | None = None, out_bf16: bool = False
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias, fp32) -> [M, N]: bf16 with `out_bf16`, else fp32. x is rounded to bf16 first,
    as the dense GEMM's input is."""
    kernels = cpu_kernels()
    assert kernels is not None
    out: torch.Tensor = kernels.bf16_panel_linear(x.to(torch.bfloat16).contiguous(), panel.data,
                                                  panel.out_features, bias, out_bf16)
    return out
