"""4-bit packed copies of weights, for steps of a few tokens on CPU.

A decode step of one or a few sequences is a matrix-vector product: its time is
the time to read the weights. Reading them as 4-bit groups instead of bf16 is
about 2x faster with PyTorch's int4 CPU kernel; for larger batches the dense
bf16 GEMM is faster, so the model keeps both and picks per step.

A copy is made only when it is lossless up to bf16 rounding of the group
scale and offset — as it is for weights that came from a GGUF Q4_1 file, whose
groups of 32 are exactly `scale * q + min` with q in 0..15. Weights that would
lose precision stay dense only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
# Largest error allowed after repacking, as a fraction of each group's quantization step. The
# bf16 weights we repack are themselves rounded (up to ~0.04 step from the exact Q4_1 grid), and
# bf16 scale/offset add about as much: the 4-bit copy is as close to the file as the dense one.
TOLERANCE = 0.1


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass
class PackedInt4:
    packed: torch.Tensor  # [N, K / 2] uint8, the kernel's layout
    scales_zeros: torch.Tensor  # [K / group, N, 2] bf16: w = (q - 8) * scale + zero
    group_size: int


def pack_int4_lossless(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> PackedInt4 | None:
    """Pack an [N, K] weight as asymmetric 4-bit groups along K, or None if that would change it."""
    n, k = weight.shape
    if k % group_size or n % 8:
        return None
    w = weight.float().view(n, k // group_size, group_size)
    low = w.amin(-1, keepdim=True)
    step = (w.amax(-1, keepdim=True) - low) / 15
    safe_step = step.clamp(min=torch.finfo(torch.float32).tiny)
    q = ((w - low) / safe_step).round().clamp(0, 15)
    scale = step.squeeze(-1).to(torch.bfloat16)
    zero = (low + 8 * step).squeeze(-1).to(torch.bfloat16)
    restored = (q - 8) * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    err = (restored - w).abs().amax(-1)
    if bool((err > TOLERANCE * step.squeeze(-1) + 1e-6 * w.abs().amax(-1)).any()):
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return PackedInt4(packed, scales_zeros, group_size)


def int4_linear(x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w.packed, w.group_size, w.scales_zeros)
    return y if bias is None else y + bias
