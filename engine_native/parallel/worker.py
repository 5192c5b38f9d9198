"""A worker rank (1..N-1) of a tensor-parallel engine: `python -m engine_native.parallel.worker SPEC`.

It holds its slice of the weights and of the KV pool, and nothing else: each step it receives the
batch rank 0 broadcasts, runs its part of the forward (joining the all-reduces) and waits for the
next. It exits when rank 0 says so, when a collective fails (a rank died), or, started on rank 0's
host, when rank 0's process dies (PR_SET_PDEATHSIG), so the group lives and dies as one.

SPEC is a JSON `WorkerSpec`; on another host it is the same command with that host's rank.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import msgspec

from engine_native.config import EngineConfig

log = logging.getLogger("engine_native.parallel.worker")

PR_SET_PDEATHSIG = 1


class WorkerSpec(msgspec.Struct, kw_only=True):
    config: EngineConfig
    rank: int
    master_port: int
    dtype: str  # the torch dtype's name: "float32", "bfloat16"
    num_threads: int
    parent_pid: int | None = None  # set when started by rank 0 on its own host


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return  # not Linux: the failed collective still ends us
    if os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        sys.exit(1)


def run(spec: WorkerSpec) -> None:
    import torch

    from engine_native.forward_batch import KVCache
    from engine_native.host_memory import retain_freed_memory
    from engine_native.parallel.comm import (
        KV_DTYPE_NAMES,
        CollectiveClock,
        RankLostError,
        init_group,
        receive_step,
    )
    from engine_native.parallel.loading import load_shard
    from engine_native.parallel.placement import Placement

    par = spec.config.parallel
    retain_freed_memory()
    torch.set_num_threads(spec.num_threads)
    init_group(par.backend, par.master_addr, spec.master_port, spec.rank, par.world_size, par.timeout_s)
    clock = CollectiveClock()
    dtype = getattr(torch, spec.dtype)
    placement = Placement(par.tensor_parallel_size, par.pipeline_parallel_size, spec.rank,
                          micro_batches=par.micro_batches)
    loaded = load_shard(spec.config.model_path, dtype, placement, clock, False)
    model = loaded.model
    kv_spec = clock.broadcast(torch.empty(3, dtype=torch.int64)).tolist()  # from EngineGroup.runner
    num_blocks, block_size, kv_code = kv_spec
    local = model.config
    kv = KVCache.allocate(
        local.num_layers, num_blocks, block_size, local.num_kv_heads, local.head_dim, getattr(torch, KV_DTYPE_NAMES[kv_code])
    )
    log.info("rank %d ready: %d layers, %d heads, %d KV heads, %d KV blocks", spec.rank, local.num_layers,
             local.num_heads, local.num_kv_heads, num_blocks)
    try:
        with torch.inference_mode():
            while (batch := receive_step(clock)) is not None:
                model.forward(batch, kv)
    except RankLostError as exc:
        log.error("rank %d: the group is broken (%s); exiting", spec.rank, exc)
        sys.exit(1)


def main() -> None:
    spec = msgspec.json.decode(sys.argv[1], type=WorkerSpec)
    logging.basicConfig(
        level=os.environ.get("SLUICE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s engine[{spec.config.node_id}] rank {spec.rank} %(name)s: %(message)s",
    )
    if spec.parent_pid is not None:
        _die_with_parent(spec.parent_pid)
    run(spec)


if __name__ == "__main__":
    main()
