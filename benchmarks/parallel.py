"""`sluice bench parallel`: a step's time split into compute and communication at TP = 1, 2, 3 and PP = 2.

Drives `LLMEngine` in this process on the bundled SmolLM2 (fp32, dense path at every size so the
sizes compare like for like) with the worker ranks as real processes over gloo. For each size it
times a prefill step of `--prefill` tokens and the median of pure decode steps of `--batch`
sequences; rank 0's collective clock (the step broadcast, the all-reduces and pipeline sends and
receives, waits for slower ranks included) gives the communication part. `1x2/1` is PP = 2 without
micro-batching, to set against `1x2`. A bare all-reduce probe first gives gloo's latency and rate
here, which docs/parallelism.md calibrates with.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

DECODE_STEPS = 12
PROBE_SIZES = (1024, 16 * 1024, 256 * 1024, 4 * 1024 * 1024)  # bytes of one all-reduce (fp32)
PROBE_REPEATS = 20


@dataclass
class StepSplit:
    step_s: float
    collective_s: float
    collective_bytes: int
    collectives: int

    @property
    def compute_s(self) -> float:
        return self.step_s - self.collective_s


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("parallel", help="tensor-parallel step time split into compute and communication")
    p.add_argument("--layouts", default="1x1,2x1,3x1,1x2,1x2/1",
                   help="TPxPP[/micro-batches], comma-separated (micro-batches default to PP; /1: none)")
    p.add_argument("--batch", type=int, default=8, help="sequences in a decode step")
    p.add_argument("--prefill", type=int, default=256, help="tokens of the timed prefill step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--probe-ranks", type=int, default=2, help="ranks of the bare all-reduce probe (0: skip)")
    p.set_defaults(func=run)


def _measure(layout: str, args: argparse.Namespace) -> tuple[StepSplit, StepSplit]:
    from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_native.engine import LLMEngine
    from engine_native.model.bundled import bundled_model_path
    from engine_native.sampling_params import SamplingParams

    config = EngineConfig(
        model_path=bundled_model_path(), dtype="float32", quantized_max_rows=0, num_threads=args.threads,
        cache=CacheConfig(num_blocks=512, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=args.batch + 1, max_num_batched_tokens=max(512, args.prefill),
                                  long_prefill_token_threshold=max(512, args.prefill)),
        parallel=_parallel(layout),
    )
    engine = LLMEngine(config, progress=False)

    def timed_step() -> StepSplit:
        clock = engine.group.clock if engine.group else None
        before = (clock.seconds, clock.bytes, clock.calls) if clock else (0.0, 0, 0)
        t0 = time.perf_counter()
        engine.step()
        step = time.perf_counter() - t0
        after = (clock.seconds, clock.bytes, clock.calls) if clock else (0.0, 0, 0)
        return StepSplit(step, after[0] - before[0], after[1] - before[1], after[2] - before[2])

    try:
        params = SamplingParams(max_tokens=DECODE_STEPS + 4, temperature=0.0, ignore_eos=True)
        engine.add_request("prefill", [1000 + i % 5000 for i in range(args.prefill)], SamplingParams(max_tokens=1))
        prefill = timed_step()
        for i in range(args.batch):
            engine.add_request(f"d{i}", [2000 + 7 * i + j for j in range(32)], params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        engine.step()
        decodes = [timed_step() for _ in range(DECODE_STEPS)]
        decodes.sort(key=lambda s: s.step_s)
        return prefill, decodes[len(decodes) // 2]
    finally:
        engine.close()


def _parallel(layout: str) -> Any:
    from engine_native.config import ParallelConfig

    sizes, _, micro = layout.partition("/")
    tp, pp = (int(x) for x in sizes.split("x"))
    return ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batches=int(micro or 0))


def _probe_rank(rank: int, world: int, port: int, out: Any) -> None:
    """One rank of the bare all-reduce probe: the median time of each size, reported by rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    medians = []
    for size in PROBE_SIZES:
        t = torch.ones(size // 4)
        dist.all_reduce(t)  # warm-up: connections, buffers
        times = []
        for _ in range(PROBE_REPEATS):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        medians.append(sorted(times)[len(times) // 2])
    if rank == 0:
        out.put(medians)
    dist.destroy_process_group()


def _probe(world: int) -> list[float]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_probe_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    medians: list[float] = out.get(timeout=300)
    for p in procs:
        p.join()
    return medians


def run(args: argparse.Namespace) -> int:
    if args.probe_ranks > 1:
        medians = _probe(args.probe_ranks)
        print(f"bare gloo all-reduce over loopback, {args.probe_ranks} ranks, median of {PROBE_REPEATS}:")
        for size, m in zip(PROBE_SIZES, medians, strict=True):
            print(f"  {size / 1024:>8.0f} KiB  {m * 1e6:>9.0f} us  {size / m / 1e6:>8.1f} MB/s (payload)")
    print(f"SmolLM2-135M fp32, gloo on this host, {args.threads} thread(s) per rank; "
          f"decode step = median of {DECODE_STEPS} steps of {args.batch} sequences")
    print(f"{'layout':>7} {'step':>7} {'tokens':>6} {'step ms':>9} {'compute ms':>11} {'comm ms':>8} "
          f"{'comm %':>7} {'msgs':>5} {'KiB':>8} {'tok/s':>7}")
    for layout in args.layouts.split(","):
        prefill, decode = _measure(layout, args)
        for name, tokens, s in (("prefill", args.prefill, prefill), ("decode", args.batch, decode)):
            print(f"{layout:>7} {name:>7} {tokens:>6} {s.step_s * 1e3:>9.2f} {s.compute_s * 1e3:>11.2f} "
                  f"{s.collective_s * 1e3:>8.2f} {100 * s.collective_s / s.step_s:>6.1f}% {s.collectives:>5} "
                  f"{s.collective_bytes / 1024:>8.1f} {tokens / s.step_s:>7.1f}")
    return 0
