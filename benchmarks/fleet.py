"""`sluice bench fleet`: what the fleet's extra hop (router, HTTP to workers, failover bookkeeping) costs.

In one run, the same load twice through a real gateway, driven by `benchmarks.serve.run_benchmark`
(completions, streaming, `num_prompts` at `concurrency`):

(a) in-process: `sluice serve --driver synthetic` (the engine in the gateway's process);
(b) fleet: `sluice serve --driver fleet --workers ...` over `workers` `sluice worker --driver synthetic`
    processes, the same synthetic pace per request.

Prints requests/s and TTFT p50 / p99 of both and the ratio fleet/in-process of requests/s (target
>= 0.9). The synthetic engine paces its tokens, so the figures measure overhead, not a model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.serve import BenchConfig, BenchResult, run_benchmark
from benchmarks.server_process import ServerProcess
from benchmarks.worker_process import worker_processes

TARGET_RATIO = 0.9


@dataclass(frozen=True)
class FleetBenchConfig:
    workers: int = 4
    num_prompts: int = 256
    concurrency: int = 32
    input_len: int = 64
    output_len: int = 32
    tokens_per_second: float = 50.0  # per request, the synthetic engine's pace
    ttft_ms: float = 50.0
    policy: str = "least-loaded"


def _load(config: FleetBenchConfig, base_url: str, num_prompts: int) -> BenchResult:
    return asyncio.run(run_benchmark(BenchConfig(
        base_url=base_url, endpoint="completions", num_prompts=num_prompts, input_len=config.input_len,
        output_len=config.output_len, ignore_eos=True, temperature=0.0, max_concurrency=config.concurrency,
        progress=False,
    )))


def _measure(config: FleetBenchConfig, options: list[str]) -> BenchResult:
    with ServerProcess(options, startup_timeout_s=120) as server:
        _load(config, server.base_url, 8)  # warm-up: connections, first imports
        result = _load(config, server.base_url, config.num_prompts)
    if result.failed or not result.completed:
        raise RuntimeError(f"{result.failed} failed requests: {result.errors[:3]}")
    return result


def run(config: FleetBenchConfig) -> dict[str, Any]:
    pace = ["--synthetic-tokens-per-second", str(config.tokens_per_second), "--synthetic-ttft-ms", str(config.ttft_ms),
            "--max-num-seqs", "256", "--max-waiting", "1024"]
    local = _measure(config, ["--driver", "synthetic", *pace, "--no-load-shedding"])
    with worker_processes(config.workers, "--driver", "synthetic", *pace) as workers:
        urls = ",".join(w.url for w in workers)
        fleet = _measure(config, ["--driver", "fleet", "--workers", urls, "--fleet-policy", config.policy,
                                  "--no-load-shedding"])
    ratio = fleet.request_throughput / local.request_throughput if local.request_throughput else 0.0
    for name, r in (("in-process", local), (f"fleet ({config.workers} workers)", fleet)):
        print(f"{name:<22} {r.request_throughput:7.2f} req/s  TTFT p50 {r.ttft_ms.p50:7.1f} ms  "
              f"p99 {r.ttft_ms.p99:7.1f} ms  ITL p50 {r.itl_ms.p50:6.1f} ms")
    print(f"ratio fleet/in-process (req/s): {ratio:.3f} (target >= {TARGET_RATIO}) -> "
          f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}")
    load = os.getloadavg()
    print(f"load average (1/5/15 min): {load} -- figures measured under that load")
    return {"config": asdict(config), "in_process": json.loads(local.to_json()), "fleet": json.loads(fleet.to_json()),
            "ratio": ratio, "target": TARGET_RATIO, "met": ratio >= TARGET_RATIO, "load_average": load}


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet", help="fleet overhead: synthetic driver in-process vs behind N sluice workers",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = FleetBenchConfig()
    p.add_argument("--workers", type=int, default=d.workers, help="sluice worker processes")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per half")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--tokens-per-second", type=float, default=d.tokens_per_second, help="synthetic pace per request")
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="synthetic time to first token")
    p.add_argument("--policy", default=d.policy, help="the fleet's routing policy")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = FleetBenchConfig(workers=args.workers, num_prompts=args.num_prompts, concurrency=args.concurrency,
                              input_len=args.input_len, output_len=args.output_len,
                              tokens_per_second=args.tokens_per_second, ttft_ms=args.ttft_ms, policy=args.policy)
    report = run(config)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
