"""Sluice's own CPU kernels (C++ with AVX2 intrinsics), compiled on first use and cached.

`quant_linear()` returns the compiled module with `q4_1_linear` and `q8_0_linear` (see
quant_linear.cpp for what they compute), or None where they cannot run: a CPU without AVX2/FMA,
no C++ compiler, or SLUICE_KERNELS=0. Callers then use the dense path; nothing else changes.

The build goes through torch.utils.cpp_extension (ninja, the host's g++) into
~/.cache/sluice/kernels/<key>, where the key covers the source, torch's version and this CPU's
flags, so a copied cache never runs code built for another CPU. It takes ~30-60 s once per host;
a file lock keeps concurrent engine processes from building it twice.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_linear.cpp")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _build_dir() -> Path:
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(_cpu_flags().encode())
    root = Path(os.environ.get("SLUICE_KERNEL_CACHE", Path.home() / ".cache" / "sluice" / "kernels"))
    path = root / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def quant_linear() -> ModuleType | None:
    if os.environ.get("SLUICE_KERNELS", "1").lower() in ("0", "false", "off", "no"):
        return None
    if not torch.cpu._is_avx2_supported():
        log.info("no AVX2 on this CPU: quantized kernels off, dense weights only")
        return None
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="sluice_quant_linear",
            sources=[str(_SOURCE)],
            build_directory=str(_build_dir()),
            extra_cflags=["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-DNDEBUG"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja: serve with the dense path
        log.warning("building the quantized kernels failed, using dense weights only: %s", exc)
        return None
