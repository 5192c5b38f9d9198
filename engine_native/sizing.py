"""Sizes the KV block pool from the cache config and the memory the host has."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_native.config import EngineConfig, ModelConfig
from engine_native.kv_cache_manager import cdiv

if TYPE_CHECKING:  # no torch at import: the gateway sizes a model version from DEFAULT_MAX_KV_BYTES and the host
    import torch

    from engine_native.device import MemoryInfo

# Without an explicit size, the pool never takes more than this much memory:
# on a shared CPU host the page cache and the other processes need the rest.
DEFAULT_MAX_KV_BYTES = 2 * 1024**3


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo; falls back to 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3


def kv_budget_bytes(free_bytes: int, fraction: float) -> int:
    """The KV pool's share of a device's free memory."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"device_memory_fraction must be in (0, 1], not {fraction}")
    return int(free_bytes * fraction)


def kv_bytes_per_block(model: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    return model.kv_bytes_per_token * kv_dtype.itemsize * block_size


def num_kv_blocks(
    config: EngineConfig,
    model: ModelConfig,
    kv_dtype: torch.dtype,
    max_model_len: int,
    device_memory: MemoryInfo | None = None,
) -> int:
    """`device_memory`: the (free, total) bytes of the accelerator the pool lives on, read after the
    weights are there; None: the pool is host memory."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(model, cache.block_size, kv_dtype)
    if cache.memory_bytes is not None:
        budget = cache.memory_bytes
    elif device_memory is not None:
        # A GPU is not shared with a page cache: the pool takes its share of what is free, uncapped.
        budget = kv_budget_bytes(device_memory()[0], cache.device_memory_fraction)
    else:
        budget = min(int(available_memory_bytes() * cache.memory_fraction), DEFAULT_MAX_KV_BYTES)
    blocks = budget // per_block
    # More than every running sequence at full context could ever use is waste.
    ceiling = config.scheduler.max_num_seqs * cdiv(max_model_len, cache.block_size)
    # A pool smaller than one full context still works: requests that could never fit are refused.
    return max(1, int(min(blocks, ceiling)))


DEFAULT_CUDA_SWAP_BYTES = 4 * 1024**3


def num_swap_blocks(config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype, device: torch.device) -> int:
    """Blocks of the host pool preempted requests are swapped to (swap.py); 0: preemption recomputes."""
    cache = config.cache
    if cache.swap_num_blocks is not None:
        return cache.swap_num_blocks
    per_block = kv_bytes_per_block(model, cache.block_size, kv_dtype)
    if cache.swap_space_bytes is not None:
        return cache.swap_space_bytes // per_block
    return DEFAULT_CUDA_SWAP_BYTES // per_block if device.type == "cuda" else 0
