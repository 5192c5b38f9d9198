"""Where the engine computes: the device, the dtype it computes in there, and the KV budget it gets.

`--device cpu|cuda|auto` ends here. On CPU nothing changes from the CPU-only engine (precision.py
picks the dtype, sizing.py reads /proc/meminfo). On CUDA the weights are bf16 unless asked
otherwise, the quantized CPU blocks (and the C++ kernels) are off, and the KV pool is a fraction
of the device memory still free once the weights are there.

The CUDA paths run on a GPU only in scripts/gpu_check.sh (first on an H200, 2026-12-04; CI has no
GPU); everything here that can run without a GPU is tested on CPU, with the availability and
memory-info functions injected rather than patched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_native.precision import parse_dtype

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# (free, total) bytes of one device, as torch.cuda.mem_get_info answers.
MemoryInfo = Callable[[], tuple[int, int]]


def resolve_device(name: str, cuda_available: Callable[[], bool] = torch.cuda.is_available) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:N' | 'auto' -> the device; 'auto' is cuda when torch sees one."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda") if cuda_available() else torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not cuda_available():
            raise ValueError(
                f"device {name!r} asked for, but torch sees no CUDA device (the default install is the CPU "
                "build of torch; see `make install-gpu`)"
            )
        return torch.device(name)
    raise ValueError(f"unsupported device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weights' dtype: bf16 for 'auto' on a GPU (tensor cores run it natively); on CPU precision.py decides."""
    if device.type == "cpu":
        return parse_dtype(name)
    return torch.bfloat16 if name == "auto" else parse_dtype(name)


def device_memory_info(device: torch.device) -> MemoryInfo | None:
    """How sizing.py reads the device's free memory; None on CPU, where /proc/meminfo is the source."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.mem_get_info(device)


def describe(device: torch.device) -> str:
    """A device as logs and /admin/nodes name it: 'cpu', or 'cuda:0 (NVIDIA H200)'."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
