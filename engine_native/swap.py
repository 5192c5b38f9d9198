"""Swap-to-host preemption: a preempted request's KV blocks wait in a host pool instead of being
recomputed, and come back to fresh device blocks when it is scheduled again.

The scheduler decides (`SwapPolicy.should_swap`: mode, room in the host pool, cost estimate) and
records block copies on the `SchedulerOutput`; the engine issues them (`copy_blocks`) before the
step's forward, swap-outs first, so a device block freed by a swap-out can be refilled in the same
step. On CUDA the host pool is pinned memory; on CPU a second CPU pool stands in, so the same code
runs (and is tested) without a GPU.

    device pool:  | request's blocks (num_computed_tokens of KV) |  --swap_out-->  host pool
    host pool:    | same blocks, same order                      |  --swap_in--->  new device blocks

A swapped request keeps `num_computed_tokens` and status PREEMPTED; it holds host blocks only, which
`HostSwapSpace.holds` tells. Host blocks given back by a swap-in are released at the end of the
step, after its copies, so no swap-out of the same step can overwrite them first.

Invariant (`HostSwapSpace.check_integrity`): free + held + releasing == num_blocks, no block twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_native.config import ModelConfig
from engine_native.forward_batch import KVCache

# (source block, destination block) pairs of one direction's copies in a step
BlockCopies = list[tuple[int, int]]

PREEMPTION_MODES = ("recompute", "swap", "auto")


class HostSwapSpace:
    """Which host blocks hold which swapped request's KV (bookkeeping only: the tensors are a `KVCache`)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}
        self._releasing: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def swap_out(self, request_id: str, device_blocks: list[int]) -> BlockCopies | None:
        """Host blocks for `device_blocks`, as (device, host) copies; None when the pool lacks room."""
        if len(device_blocks) > len(self._free) or request_id in self._tables:
            return None
        host = [self._free.pop() for _ in device_blocks]
        self._tables[request_id] = host
        return list(zip(device_blocks, host, strict=True))

    def swap_in(self, request_id: str, device_blocks: list[int]) -> BlockCopies:
        """(host, device) copies that bring the request's KV back into `device_blocks` (its new table's
        head); its host blocks are released at `end_step`."""
        host = self._tables.pop(request_id)
        if len(device_blocks) < len(host):
            raise ValueError(f"{len(host)} swapped blocks need as many device blocks, got {len(device_blocks)}")
        self._releasing.extend(host)
        return list(zip(host, device_blocks, strict=False))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables[request_id])

    def free(self, request_id: str) -> None:
        """Drop a swapped request's KV (aborted while swapped); a no-op for others."""
        self._releasing.extend(self._tables.pop(request_id, []))

    def end_step(self) -> None:
        """The step's copies were issued: host blocks swapped in may now be handed out again."""
        self._free.extend(self._releasing)
        self._releasing.clear()

    def check_integrity(self) -> None:
        held = [b for t in self._tables.values() for b in t]
        every = held + self._free + self._releasing
        if len(set(every)) != len(every):
            raise AssertionError("a host block is held, free or releasing twice")
        if len(every) != self.num_blocks:
            raise AssertionError(f"host blocks: {len(every)} accounted for, {self.num_blocks} exist: a block leaked")


@dataclass(frozen=True)
class PreemptionCost:
    """Seconds to swap a request's KV out and back in, against seconds to recompute it.

    recompute(n) = (2 * params * n + 2 * layers * hidden * n^2) / flops_per_s   (GEMMs + causal attention)
    swap(n)      = fixed_s + 2 * n * kv_bytes_per_token / copy_bytes_per_s        (out now, in later)

    Recompute grows with the square of the context, the copy linearly: long contexts swap, short
    ones recompute (a fixed launch cost dominates). The rates are estimates per device kind
    (`for_device`), not measurements.
    """

    params: int
    num_layers: int
    hidden_size: int
    kv_bytes_per_token: int
    flops_per_s: float
    copy_bytes_per_s: float
    fixed_s: float

    def recompute_s(self, num_tokens: int) -> float:
        n = num_tokens
        return (2 * self.params * n + 2 * self.num_layers * self.hidden_size * n * n) / self.flops_per_s

    def swap_s(self, num_tokens: int) -> float:
        return self.fixed_s + 2 * num_tokens * self.kv_bytes_per_token / self.copy_bytes_per_s

    def prefers_swap(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self.swap_s(num_tokens) < self.recompute_s(num_tokens)

    @classmethod
    def for_device(cls, model: ModelConfig, kv_dtype: torch.dtype, device: torch.device) -> PreemptionCost:
        h, i, layers = model.hidden_size, model.intermediate_size, model.num_layers
        kv = model.num_kv_heads * model.head_dim
        params = layers * (h * (h + 2 * kv) + h * h + 3 * h * i) + model.vocab_size * h
        elem = torch.empty((), dtype=kv_dtype).element_size()
        if device.type == "cuda":  # a fraction of an H100/H200's bf16 rate; pinned PCIe 4/5 copies
            flops, copy, fixed = 2e14, 2e10, 2e-4
        else:  # a few CPU cores; a memcpy between two host pools
            flops, copy, fixed = 2e11, 5e9, 1e-4
        return cls(params, layers, h, model.kv_bytes_per_token * elem, flops, copy, fixed)


@dataclass
class SwapPolicy:
    """What the scheduler asks before a preemption: swap this request, or recompute it?"""

    space: HostSwapSpace
    mode: str  # "recompute" | "swap" | "auto"
    cost: PreemptionCost | None = None  # needed by "auto"

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"unsupported preemption mode {self.mode!r}; choose one of {', '.join(PREEMPTION_MODES)}")

    def should_swap(self, num_computed_tokens: int, num_blocks: int) -> bool:
        if self.mode == "recompute" or num_computed_tokens == 0 or num_blocks > self.space.num_free:
            return False
        if self.mode == "swap":
            return True
        return self.cost is not None and self.cost.prefers_swap(num_computed_tokens)


def copy_blocks(src: KVCache, dst: KVCache, copies: BlockCopies) -> None:
    """Copy whole blocks, every layer's K and V, from one pool to another (device <-> host).

    Blocking copies: swaps are rare, and a copy that has landed before the forward is what keeps a
    freed device block from being overwritten while it is read."""
    if not copies:
        return
    src_dev, dst_dev = src.k[0].device, dst.k[0].device
    src_ids = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=src_dev)
    dst_ids = torch.tensor([d for _, d in copies], dtype=torch.int64, device=dst_dev)
    for s_layer, d_layer in zip(src.k + src.v, dst.k + dst.v, strict=True):
        d_layer.index_copy_(0, dst_ids, s_layer.index_select(0, src_ids).to(dst_dev))
