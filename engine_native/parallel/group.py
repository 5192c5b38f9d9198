"""Rank 0 of a tensor-parallel engine: starts the worker ranks, and runs each step across them.

Rank 0 is the engine process: `LLMEngine` keeps its scheduler, KV block bookkeeping and sampler
there, and swaps the `ModelRunner` for a `DistributedRunner`, which broadcasts each step's batch
before running rank 0's own slice of the forward. Workers are plain subprocesses
(`python -m engine_native.parallel.worker`), joined by a torch.distributed TCP rendezvous at
`ParallelConfig.master_addr:master_port`.

Lives and dies as one: before every step rank 0 checks that each worker process is still there,
and a rank dying inside a step fails its collective; either raises `RankLostError` out of
`LLMEngine.step()`, which the engine process reports as `EngineFailed` (every request in flight
ends with an error, the client marks the engine dead). Workers die with rank 0's process.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from engine_native.config import EngineConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.base import LoadedModel
from engine_native.parallel.comm import (
    KV_DTYPE_NAMES,
    CollectiveClock,
    RankLostError,
    init_group,
    send_shutdown,
    send_step,
)
from engine_native.parallel.loading import load_shard
from engine_native.parallel.placement import Placement
from engine_native.parallel.worker import WorkerSpec
from engine_native.runner import BlockTableLookup, ModelRunner
from engine_native.scheduler import RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.1
SHUTDOWN_WAIT_S = 5.0


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


class EngineGroup:
    """The worker processes and the process group, seen from rank 0."""

    def __init__(self, config: EngineConfig, workers: list[subprocess.Popen[bytes]], loaded: LoadedModel,
                 clock: CollectiveClock) -> None:
        self.config = config
        self.workers = workers
        self.loaded = loaded  # rank 0's slice; .config is the full model's
        self.clock = clock
        self.forward_s = 0.0  # rank 0's time in the runner (compute + collectives), since start
        self.broken: str | None = None

    @classmethod
    def start(cls, config: EngineConfig, dtype: torch.dtype, progress: bool) -> EngineGroup:
        par = config.parallel
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // par.world_size)
        torch.set_num_threads(threads)
        port = par.master_port or _free_port(par.master_addr)
        workers = [cls._spawn(config, rank, port, dtype, threads) for rank in range(1, par.world_size)]
        try:
            cls._join(config, port, workers)
            clock = CollectiveClock()
            placement = Placement(par.tensor_parallel_size, par.pipeline_parallel_size, 0,
                                  micro_batches=par.micro_batches)
            loaded = load_shard(config.model_path, dtype, placement, clock, True)
        except BaseException:
            _kill(workers)
            raise
        log.info("parallel group ready: tp=%d pp=%d (rendezvous %s:%d)", par.tensor_parallel_size,
                 par.pipeline_parallel_size, par.master_addr, port)
        return cls(config, workers, loaded, clock)

    @staticmethod
    def _spawn(config: EngineConfig, rank: int, port: int, dtype: torch.dtype, threads: int) -> subprocess.Popen[bytes]:
        spec = WorkerSpec(config=config, rank=rank, master_port=port, dtype=str(dtype).removeprefix("torch."),
                          num_threads=threads, parent_pid=os.getpid())
        prefixes = config.parallel.worker_launch_prefix
        prefix = list(prefixes[min(rank - 1, len(prefixes) - 1)]) if prefixes else []
        cmd = [*prefix, sys.executable, "-m", "engine_native.parallel.worker", msgspec.json.encode(spec).decode()]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    @staticmethod
    def _join(config: EngineConfig, port: int, workers: list[subprocess.Popen[bytes]]) -> None:
        """The rendezvous, failing fast when a worker dies before joining (it would wait out the timeout)."""
        par = config.parallel
        failure: list[BaseException] = []

        def rendezvous() -> None:
            try:
                init_group(par.backend, par.master_addr, port, 0, par.world_size, par.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failure.append(exc)

        thread = threading.Thread(target=rendezvous, daemon=True)
        thread.start()
        deadline = time.monotonic() + par.timeout_s
        while thread.is_alive():
            thread.join(JOIN_POLL_S)
            lost = [f"rank {r} exited with {w.returncode}" for r, w in enumerate(workers, 1) if w.poll() is not None]
            if lost:
                raise RankLostError(f"a worker died before the group formed: {', '.join(lost)}")
            if time.monotonic() > deadline:
                raise RankLostError(f"the group did not form within {par.timeout_s} s")
        if failure:
            raise RankLostError(f"rendezvous failed: {failure[0]}")

    def check_alive(self) -> None:
        if self.broken:
            raise RankLostError(self.broken)
        for rank, w in enumerate(self.workers, 1):
            if w.poll() is not None:
                self.broken = f"rank {rank} exited with {w.returncode}"
                raise RankLostError(self.broken)

    def runner(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> DistributedRunner:
        """Tell the workers the pool's size and allocate rank 0's slice of it."""
        code = KV_DTYPE_NAMES.index(str(kv_dtype).removeprefix("torch."))
        # Timed by a clock of its own: this broadcast waits for the slowest worker's load, which is no step's
        # collective (EngineStats counts the group's collectives within the runner's time; under load this wait
        # alone once exceeded a short run's whole forward time).
        CollectiveClock().broadcast(torch.tensor([num_blocks, block_size, code], dtype=torch.int64))
        local = self.loaded.model.config
        kv = KVCache.allocate(local.num_layers, num_blocks, block_size, local.num_kv_heads, local.head_dim, kv_dtype)
        return DistributedRunner(self, kv, block_size)

    def close(self) -> None:
        """Stop the workers and leave the process group (best effort when the group is broken)."""
        if not self.broken and all(w.poll() is None for w in self.workers):
            try:
                send_shutdown(self.clock)
            except RankLostError:
                pass
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for w in self.workers:
            try:
                w.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self.broken = self.broken or "the group was shut down"
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(workers: list[subprocess.Popen[bytes]]) -> None:
    for w in workers:
        if w.poll() is None:
            w.kill()
        w.wait()


class DistributedRunner(ModelRunner):
    """`ModelRunner` on rank 0 of a group: the step's batch goes to every rank before the forward."""

    def __init__(self, group: EngineGroup, kv_cache: KVCache, block_size: int) -> None:
        super().__init__(group.loaded.model, kv_cache, block_size)
        self.group = group

    def build_batch(self, sched: SchedulerOutput, block_table: BlockTableLookup) -> ForwardBatch:
        self.group.check_alive()
        batch = super().build_batch(sched, block_table)
        try:
            send_step(self.group.clock, batch)
        except RankLostError as exc:
            self.group.broken = str(exc)
            raise
        return batch

    def execute(self, sched: SchedulerOutput, block_table: BlockTableLookup) -> RunnerOutput:
        start = time.perf_counter()
        try:
            return super().execute(sched, block_table)
        except RankLostError as exc:
            self.group.broken = self.group.broken or str(exc)
            raise
        finally:
            self.group.forward_s += time.perf_counter() - start
