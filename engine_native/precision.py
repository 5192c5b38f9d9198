"""Which floating-point type the engine computes in on this host.

bf16 halves the bytes a weight read costs, but only CPUs with native bf16 arithmetic
(AVX-512 BF16 or AMX) run bf16 GEMMs at speed. Elsewhere (AVX2-only CPUs, for one)
PyTorch emulates them by converting to fp32 and a bf16 GEMM runs about 4x slower than
the fp32 one; fp32 is then both faster and exact. `"auto"` (the default) picks bf16 only
where the CPU computes it natively.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Each accepted name -> its dtype's name, which is also the dtype's attribute of torch.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}
# The kernel's names for what torch.cpu's checks ask the CPU for: AVX-512 BF16, AMX tiles.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_tile"})


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic instructions (AVX-512 BF16 or AMX tiles). Read from the kernel's
    CPU flags where it lists them (Linux on x86), so that a process without torch (the gateway sizing a
    model version) decides as the engine does; elsewhere torch's own check."""
    flags = _kernel_cpu_flags()
    if flags is not None:
        return not flags.isdisjoint(_NATIVE_BF16_FLAGS)
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _kernel_cpu_flags() -> frozenset[str] | None:
    """The first CPU's `flags` line of /proc/cpuinfo; None where there is none (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def dtype_name(name: str) -> str:
    """'auto' | 'float32' | 'bfloat16' (or fp32 / bf16) -> the name of the dtype the engine computes in."""
    if name == "auto":
        return "bfloat16" if native_bf16() else "float32"
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}") from None


def parse_dtype(name: str) -> torch.dtype:
    """`dtype_name`'s dtype as torch's; torch is imported here, not above, for the processes that only need
    the name."""
    import torch

    dtype: torch.dtype = getattr(torch, dtype_name(name))
    return dtype
