"""The wire between the ranks of one engine: the process group, the per-step broadcast, the clock.

Every step rank 0 broadcasts what the scheduler decided, already flattened by the runner into
the `ForwardBatch` (token ids, positions, KV slots, block tables): the other ranks hold no
requests, only their slice of the weights and of the KV pool. Two broadcasts per step, both int64:

    header  [8]   command, T tokens, S sequences, W block-table width, L logits rows, block size, 0, 0
    payload [3T + 3S + S*W + L]   input_ids | positions | slot_mapping | query_starts | query_lens
                                  | context_lens | block_tables (row-major) | logits_indices

`CollectiveClock` times every collective a rank makes, so that a step splits into time in
collectives and time computing (`EngineStats.collective_s_total`).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from engine_native.forward_batch import ForwardBatch

HEADER_LEN = 8
KV_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the KV pool's dtype travels as its index here


class Command(IntEnum):
    STEP = 1
    SHUTDOWN = 2


class RankLostError(RuntimeError):
    """A rank of the group died or stopped answering: the whole engine is dead."""


@dataclass
class CollectiveClock:
    """Seconds and bytes spent in collectives by this rank since start."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    def all_reduce(self, t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        start = time.perf_counter()
        try:
            dist.all_reduce(t, group=group)
        except RuntimeError as exc:
            raise RankLostError(f"all-reduce failed: {exc}") from exc
        self._count(start, t)
        return t

    def isend(self, t: torch.Tensor, dst: int) -> Sent:
        """Start sending `t` to pipeline rank `dst`; `wait()` on the result before reusing `t`."""
        start = time.perf_counter()
        try:
            work = dist.isend(t, dst)
        except RuntimeError as exc:
            raise RankLostError(f"send to rank {dst} failed: {exc}") from exc
        self._count(start, t)
        return Sent(self, work, t)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        start = time.perf_counter()
        try:
            dist.recv(t, src)
        except RuntimeError as exc:
            raise RankLostError(f"receive from rank {src} failed: {exc}") from exc
        self._count(start, t)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            dist.broadcast(t, src=0)
        except RuntimeError as exc:
            raise RankLostError(f"broadcast failed: {exc}") from exc
        self._count(start, t)
        return t

    def _count(self, start: float, t: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - start
        self.bytes += t.numel() * t.element_size()
        self.calls += 1


@dataclass
class Sent:
    """A send in flight; the tensor is kept alive until it completes."""

    clock: CollectiveClock
    work: Any
    tensor: torch.Tensor

    def wait(self) -> None:
        start = time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise RankLostError(f"send failed: {exc}") from exc
        self.clock.seconds += time.perf_counter() - start


def init_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def send_step(clock: CollectiveClock, batch: ForwardBatch) -> None:
    """Rank 0: broadcast one step's batch to the other ranks."""
    t, s = batch.num_tokens, batch.num_seqs
    w = int(batch.block_tables.shape[1]) if s else 0
    n = int(batch.logits_indices.shape[0])
    header = torch.tensor([Command.STEP, t, s, w, n, batch.block_size, 0, 0], dtype=torch.int64)
    payload = torch.cat(
        [
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            torch.tensor(batch.query_starts + batch.query_lens + batch.context_lens, dtype=torch.int64),
            batch.block_tables.reshape(-1),
            batch.logits_indices,
        ]
    )
    clock.broadcast(header)
    clock.broadcast(payload)


def send_shutdown(clock: CollectiveClock) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = Command.SHUTDOWN
    clock.broadcast(header)


def receive_step(clock: CollectiveClock) -> ForwardBatch | None:
    """Ranks > 0: the next step's batch, or None when rank 0 shuts the group down."""
    header = clock.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64)).tolist()
    if header[0] == Command.SHUTDOWN:
        return None
    _, t, s, w, n, block_size = header[:6]
    payload = clock.broadcast(torch.empty(3 * t + 3 * s + s * w + n, dtype=torch.int64))
    ids, pos, slots, seq, tables, logits = payload.split([t, t, t, 3 * s, s * w, n])
    seq_list = seq.tolist()
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        query_starts=seq_list[:s],
        query_lens=seq_list[s : 2 * s],
        context_lens=seq_list[2 * s :],
        block_tables=tables.view(s, w),
        logits_indices=logits,
        block_size=block_size,
    )
