"""How the engine process holds host memory: freed memory kept instead of handed back to the kernel each
step (`retain_freed_memory`), and transparent huge pages asked for (`ask_for_huge_pages`).

glibc's malloc serves a large block (above its mmap threshold, 128 KiB at start) with a fresh mmap
and unmaps it on free, and gives the top of its heap back once more than the trim threshold is free
there. A step allocates and frees the same large activations every time (a 2,048-token prefill of the
bundled model: tens of MiB per layer), so each step faulted every one of those pages in again: 0.55
million minor page faults and half of a 1.2 s prefill step, on a host with AMX. With both thresholds
fixed, the pages stay mapped between steps: no faults, the same step in 0.63 s. What the process
holds then tracks its peak step, which is bounded by the step budget (`max_num_batched_tokens`).

Setting either threshold also stops glibc from raising them on its own. Other C libraries (musl)
have no `mallopt`: nothing changes there.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("sluice.engine")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks above it are mmapped whatever we ask
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap top kept before any is given back


def retain_freed_memory() -> bool:
    """Fix glibc's thresholds for this process; False where the C library has no mallopt."""
    try:  # the process's own symbols: its C library is loaded already (find_library would run ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not done:
        log.warning("mallopt refused the thresholds: steps may page-fault their activations in again")
    return done


def ask_for_huge_pages() -> None:
    """Have PyTorch's CPU allocator ask for transparent huge pages for its large buffers (the KV pool, the
    weights); it reads the setting at its first allocation, so call this before any. Hosts whose THP mode is
    "madvise" (the common default) otherwise give 4 KiB pages only, and the decode attention's walk over
    scattered cache blocks pays a TLB miss every few rows. A value already set is kept."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
