"""Sluice's own CPU kernels (C++ with AVX2 intrinsics), compiled on first use and cached.

`cpu_kernels()` returns the compiled module, or None where it cannot run: a CPU without AVX2/FMA,
no C++ compiler, or SLUICE_KERNELS=0. Callers then use their PyTorch path; nothing else changes.
What each function computes is written at the top of its source file:

    quant_linear.cpp     q4_1_linear, q8_0_linear: x @ W^T with W in GGUF blocks
    paged_attention.cpp  paged_decode_attention: one query per sequence over the paged KV cache
    fused_decode.cpp     FusedDecoder: a whole pure-decode step of a Llama-family model in one call
    elementwise.cpp      rms_norm, add_rms_norm, rope_write_kv, silu_mul: the row-wise steps between GEMMs
    sample.cpp           sample_rows: a token per row from softmax(logits / temperature), no truncation
    amx_linear.cpp       amx_q4_1_linear: x @ W^T with W in Q4_1 blocks through AMX (bf16 in and out), where the CPU has it
    prefill_attention.cpp  prefill_attention_kernel: prefill chunks' attention over a bf16 cache, fp32-accurate (AMX, or AVX-512 or AVX2 FMAs)
    quant_panel.cpp      q4_1_panel_linear, q8_0_panel_linear: x @ W^T for 9 to a few hundred rows, AVX-512, fp32 hosts
    bf16_panel.cpp       bf16_panel_linear: x @ W^T for decode steps of 9 to a few hundred rows, dense bf16 weights, AVX-512 BF16
    panel_decode.cpp     DecodeLayers: a pure-decode step's layers in one call where the bf16 panels or AMX take its GEMMs
    quant_rounded.cpp    quant_matmul_int16/_int8: the quant_linear products with x rounded to int16 or int8 blocks

The build goes through torch.utils.cpp_extension (ninja, the host's g++) into
~/.cache/sluice/kernels/<key>, where the key covers the source, torch's version and this CPU's
flags, so a copied cache never runs code built for another CPU, and the source folder. It takes ~30-60 s once per host.

Concurrent engine processes build it once: they queue on an flock of build.flock, which the kernel
drops when its holder dies. torch's own `lock` file is not enough: a build killed mid-way leaves it
behind and every later build waits on it forever (a CI run hung on exactly that), so the holder of
the flock removes a leftover one before building.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / n for n in ("bindings.cpp", "quant_linear.cpp", "paged_attention.cpp", "fused_decode.cpp",
                                 "elementwise.cpp", "sample.cpp", "amx_linear.cpp",
                                 "prefill_attention.cpp", "quant_panel.cpp", "bf16_panel.cpp", "panel_decode.cpp",
                                 "quant_rounded.cpp")]
_HEADERS = [_HERE / "simd.h", _HERE / "rowops.h", _HERE / "amx.h", _HERE / "balance.h", _HERE / "decode_step.h"]


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
    for source in _SOURCES + _HEADERS:
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    # torch rebuilds when the source paths change: one build folder per checkout, or two checkouts
    # (git worktrees) used in turn would rebuild every time.
    key.update(str(_HERE.resolve()).encode())
    key.update(_cpu_flags().encode())
    root = Path(os.environ.get("SLUICE_KERNEL_CACHE", Path.home() / ".cache" / "sluice" / "kernels"))
    path = root / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel's copy may not be there (a venv's
    bin/ is on PATH only when the venv is activated)."""
    import shutil

    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


_BUILD_WAIT_S = 600.0  # another process's build this long: give up on it, serve with PyTorch paths


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    with open(build_dir / "build.flock", "w") as lock_file:
        deadline = time.monotonic() + _BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir} for {_BUILD_WAIT_S:.0f} s")
                time.sleep(0.5)
        try:
            # We hold the flock, so no live process is building here: a torch `lock` is a dead one's.
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@functools.cache
def cpu_kernels() -> ModuleType | None:
    if os.environ.get("SLUICE_KERNELS", "1").lower() in ("0", "false", "off", "no"):
        return None
    if not torch.cpu._is_avx2_supported():
        log.info("no AVX2 on this CPU: Sluice's CPU kernels off, PyTorch paths only")
        return None
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        build_dir = _build_dir()
        with _build_lock(build_dir):
            return cpp_extension.load(
                name="sluice_cpu_kernels",
                sources=[str(s) for s in _SOURCES],
                build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-DNDEBUG", f"-I{_HERE}"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja: serve with PyTorch paths
        log.warning("building Sluice's CPU kernels failed, using PyTorch paths only: %s", exc)
        return None
