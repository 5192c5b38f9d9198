"""Which floating-point type the engine computes in on this host.

bf16 halves the bytes a weight read costs, but only CPUs with native bf16 arithmetic
(AVX-512 BF16 or AMX) run bf16 GEMMs at speed. Elsewhere (AVX2-only CPUs, for one)
PyTorch emulates them by converting to fp32 and a bf16 GEMM runs about 4x slower than
the fp32 one; fp32 is then both faster and exact. `"auto"` (the default) picks bf16 only
where the CPU computes it natively.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic instructions (AVX-512 BF16 or AMX tiles)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def parse_dtype(name: str) -> torch.dtype:
    """'auto' | 'float32' | 'bfloat16' (or fp32 / bf16) -> the torch dtype the engine computes in."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}") from None
