"""CUDA graphs for pure-decode steps: captured once per batch-size bucket, a step padded to the next.

A decode step of a small model on a GPU is mostly kernel-launch overhead (tens of kernels per layer,
microseconds each); replaying a captured graph launches them all at once. A graph replays fixed
tensors, so every input of the step lives in static buffers of its bucket's size, refilled before
each replay:

    rows:          | the step's B sequences                 | padding up to the bucket        |
    input_ids:     | their last tokens                      | 0                               |
    slot_mapping:  | where their new K/V go                 | the scratch block's first slot  |
    block_tables:  | their tables, padded to `width` blocks | the scratch block               |
    context_lens:  | their lengths                          | 1                               |

The scratch block is one extra block of the device pool that the allocator never hands out, so
padding rows write and read only it. Tables are `width = cdiv(max_context, block_size)` wide; a step
with a longer context, more sequences than the largest bucket, or any prefill runs eagerly.

Only active on CUDA with the `sdpa` backend (its pure-decode plan does no host work); proven on an
H200 by scripts/gpu_check.sh (greedy output identical to Hugging Face with graphs on and off; a
1-stream decode step 6x faster than eager). `pad_decode_batch`, the part that decides what a replay
computes, runs on CPU too and is tested there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.kv_cache_manager import cdiv

log = logging.getLogger(__name__)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size that holds `num_seqs`; None when none does."""
    fitting = [s for s in sizes if s >= num_seqs]
    return min(fitting) if fitting else None


def pad_decode_batch(batch: ForwardBatch, size: int, width: int, scratch_block: int) -> ForwardBatch:
    """A pure-decode host batch padded to `size` rows and `width`-block tables (see the module drawing)."""
    n, bs = batch.num_seqs, batch.block_size
    pad = size - n
    if pad < 0 or batch.block_tables.shape[1] > width:
        raise ValueError(f"a batch of {n} rows x {batch.block_tables.shape[1]} blocks does not fit {size} x {width}")
    tables = torch.full((size, width), scratch_block, dtype=torch.int64)
    tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
    # Inside a real row, blocks past its length are masked: any id does, as long as it exists.
    return ForwardBatch(
        input_ids=torch.cat([batch.input_ids, torch.zeros(pad, dtype=torch.int64)]),
        positions=torch.cat([batch.positions, torch.zeros(pad, dtype=torch.int64)]),
        slot_mapping=torch.cat([batch.slot_mapping, torch.full((pad,), scratch_block * bs, dtype=torch.int64)]),
        query_starts=list(range(size)),
        query_lens=[1] * size,
        context_lens=batch.context_lens + [1] * pad,
        block_tables=tables,
        logits_indices=torch.arange(size, dtype=torch.int64),
        block_size=bs,
        context_lens_tensor=torch.tensor(batch.context_lens + [1] * pad, dtype=torch.int64),
    )


class DecodeGraphs:
    """One captured forward per bucket, sharing one memory pool; `run` pads, refills and replays."""

    def __init__(
        self,
        model: Any,  # a CausalLM whose attention backend plans decodes without host work
        kv_cache: KVCache,
        sizes: Sequence[int],
        max_context: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(set(sizes))
        self.width = cdiv(max_context, block_size)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            empty = ForwardBatch(
                input_ids=torch.zeros(0, dtype=torch.int64), positions=torch.zeros(0, dtype=torch.int64),
                slot_mapping=torch.zeros(0, dtype=torch.int64), query_starts=[], query_lens=[], context_lens=[],
                block_tables=torch.zeros(0, 1, dtype=torch.int64), logits_indices=torch.zeros(0, dtype=torch.int64),
                block_size=self.block_size,
            )
            static = pad_decode_batch(empty, size, self.width, self.scratch_block).to(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
                self.model.forward(static, self.kv_cache)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(static, self.kv_cache)
            pool = graph.pool()
            self._graphs[size] = (graph, static, logits)
        log.info("captured CUDA graphs of decode steps for batch sizes %s (contexts <= %d tokens)",
                 self.sizes, self.width * self.block_size)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            bool(self._graphs)
            and batch.is_pure_decode
            and int(batch.logits_indices.shape[0]) == batch.num_seqs
            and batch.num_seqs <= self.sizes[-1]
            and int(batch.block_tables.shape[1]) <= self.width
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of a host-side pure-decode batch, from the replay of its bucket's graph."""
        size = bucket_for(batch.num_seqs, self.sizes)
        assert size is not None
        graph, static, logits = self._graphs[size]
        padded = pad_decode_batch(batch, size, self.width, self.scratch_block)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens_tensor"):
            getattr(static, name).copy_(getattr(padded, name), non_blocking=True)
        graph.replay()
        return logits[: batch.num_seqs]
