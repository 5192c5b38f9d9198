"""`sluice bench fleet`: what the fleet's extra hop (router, HTTP to workers, failover bookkeeping) costs.

In each of `rounds` rounds, the same load twice through a real gateway, driven by
`benchmarks.serve.run_benchmark` (completions, streaming, `num_prompts` at `concurrency`):

(a) in-process: `sluice serve --driver synthetic` (the engine in the gateway's process);
(b) fleet: `sluice serve --driver fleet --workers ...` over `workers` `sluice worker --driver synthetic`
    processes, the same synthetic pace per request.

Prints requests/s, TTFT p50 / p99 and CPU time per request (gateway, workers) of both and the ratio
fleet/in-process of requests/s per round (target >= 0.9 in every round). The workers are up (idle)
during the in-process half too, so both halves share the host's background alike. On a shared host requests/s and TTFT move with what
else runs; CPU per request is the overhead itself. The synthetic engine paces its tokens, so the figures measure overhead, not a model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.config_options import add_config_command, print_load_average, verdict
from benchmarks.serve import BenchConfig, BenchResult, run_benchmark
from benchmarks.server_process import ServerProcess
from benchmarks.worker_process import worker_processes

TARGET_RATIO = 0.9
_TICKS = os.sysconf("SC_CLK_TCK")


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
    stream_interval_ms: float = 0.0  # the workers' --stream-interval-ms
    rounds: int = 2  # in-process then fleet, once per round, over the same workers


def _load(config: FleetBenchConfig, base_url: str, num_prompts: int) -> BenchResult:
    return asyncio.run(run_benchmark(BenchConfig(
        base_url=base_url, endpoint="completions", num_prompts=num_prompts, input_len=config.input_len,
        output_len=config.output_len, ignore_eos=True, temperature=0.0, max_concurrency=config.concurrency,
        progress=False,
    )))


@dataclass(frozen=True)
class Half:
    """One side of the comparison: the load's figures and the CPU it cost, which unlike requests/s
    does not depend on what else the host runs."""

    result: BenchResult
    gateway_cpu_ms: float  # per request: the gateway process (and its children)
    workers_cpu_ms: float  # per request: every `sluice worker` process (0 in-process)

    def line(self, name: str) -> str:
        r = self.result
        return (f"{name:<22} {r.request_throughput:7.2f} req/s  TTFT p50 {r.ttft_ms.p50:7.1f} ms  "
                f"p99 {r.ttft_ms.p99:7.1f} ms  ITL p50 {r.itl_ms.p50:6.1f} ms  "
                f"CPU/request: gateway {self.gateway_cpu_ms:5.2f} ms, workers {self.workers_cpu_ms:5.2f} ms")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes so far (/proc/<pid>/stat fields 14 and 15)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def _measure(config: FleetBenchConfig, options: list[str], worker_pids: list[int]) -> Half:
    with ServerProcess(options, startup_timeout_s=120) as server:
        _load(config, server.base_url, 8)  # warm-up: connections, first imports
        gateway_pids = server.pids()
        before = cpu_seconds(gateway_pids), cpu_seconds(worker_pids)
        result = _load(config, server.base_url, config.num_prompts)
        after = cpu_seconds(gateway_pids), cpu_seconds(worker_pids)
    if result.failed or not result.completed:
        raise RuntimeError(f"{result.failed} failed requests: {result.errors[:3]}")
    n = result.completed
    return Half(result, (after[0] - before[0]) * 1000 / n, (after[1] - before[1]) * 1000 / n)


def run(config: FleetBenchConfig) -> dict[str, Any]:
    pace = ["--synthetic-tokens-per-second", str(config.tokens_per_second), "--synthetic-ttft-ms", str(config.ttft_ms),
            "--max-num-seqs", "256", "--max-waiting", "1024"]
    frames = ["--stream-interval-ms", str(config.stream_interval_ms)] if config.stream_interval_ms else []
    rounds: list[dict[str, Any]] = []
    with worker_processes(config.workers, "--driver", "synthetic", *pace, *frames) as workers:
        urls = ",".join(w.url for w in workers)
        for i in range(1, config.rounds + 1):
            local = _measure(config, ["--driver", "synthetic", *pace, "--no-load-shedding"], [])
            fleet = _measure(config, ["--driver", "fleet", "--workers", urls, "--fleet-policy", config.policy,
                                      "--no-load-shedding"], [w.process.pid for w in workers])
            lr, fr = local.result, fleet.result
            ratio = fr.request_throughput / lr.request_throughput if lr.request_throughput else 0.0
            print(f"round {i}")
            print(local.line("  in-process"))
            print(fleet.line(f"  fleet ({config.workers} workers)"))
            print(f"  ratio fleet/in-process (req/s): {ratio:.3f}  load average {os.getloadavg()[0]:.2f}")
            rounds.append({"in_process": json.loads(lr.to_json()), "fleet": json.loads(fr.to_json()),
                           "cpu_ms_per_request": {"in_process_gateway": local.gateway_cpu_ms,
                                                  "fleet_gateway": fleet.gateway_cpu_ms,
                                                  "fleet_workers": fleet.workers_cpu_ms},
                           "ratio": ratio})
    ratios = [r["ratio"] for r in rounds]
    met = bool(ratios) and min(ratios) >= TARGET_RATIO
    print(f"ratio fleet/in-process (req/s) by round: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(target >= {TARGET_RATIO} in every round) -> {verdict(met)}")
    load = print_load_average()
    return {"config": asdict(config), "rounds": rounds, "target": TARGET_RATIO, "met": met, "load_average": load}


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_config_command(
        sub, "fleet", "fleet overhead: synthetic driver in-process vs behind N sluice workers",
        FleetBenchConfig(), run, options={
            "workers": "sluice worker processes",
            "num_prompts": "requests per half",
            "concurrency": "requests in flight",
            "input_len": "prompt tokens per request",
            "output_len": "output tokens per request",
            "tokens_per_second": "synthetic pace per request",
            "ttft_ms": "synthetic time to first token",
            "policy": "the fleet's routing policy",
            "stream_interval_ms": "the workers' least time between two token frames of a stream",
            "rounds": "rounds, each in-process then fleet (the host drifts between minutes: compare within a round)",
        })
