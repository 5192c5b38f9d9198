"""`sluice bench fleet-failover`: how long a stream waits when its worker dies under it.

A gateway (`--driver fleet`) over `workers` synthetic `sluice worker` processes; each round opens
`streams` concurrent streamed completions, and once every one has tokens, kill -9 the worker the
gateway has the most streams open on. For each stream, the wait from the kill to its next token;
the `k` longest waits of the round are the interrupted streams (k = the streams the gateway had open
on the victim: the others just keep their pace). One worker dies per round, so `workers - 1`
rounds at most. Prints p50 / p99 / max of the interrupted waits against the target: p99 <= 1 s plus
one prefill (the synthetic TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from benchmarks.config_options import add_config_command, print_load_average, verdict
from benchmarks.pressure import percentile
from benchmarks.server_process import ServerProcess
from benchmarks.sse_lines import sse_lines
from benchmarks.worker_process import WorkerProcess, worker_processes


@dataclass(frozen=True)
class FailoverBenchConfig:
    workers: int = 4
    rounds: int = 3
    streams: int = 24
    max_tokens: int = 200
    tokens_per_second: float = 20.0  # per stream, the synthetic pace
    ttft_ms: float = 50.0


class TimedStream:
    """One streamed completion, the monotonic time of every chunk with text."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.error: str | None = None

    async def run(self, client: httpx.AsyncClient, prompt: str, config: FailoverBenchConfig) -> None:
        body = {"model": "synthetic", "prompt": prompt, "max_tokens": config.max_tokens, "temperature": 0,
                "stream": True}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}"
                    return
                async for line in sse_lines(response):
                    if line.startswith("data: {") and '"text":""' not in line:
                        self.times.append(time.monotonic())
                    elif line.startswith("data: {") and '"error"' in line:
                        self.error = line
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def wait_after(self, t: float) -> float | None:
        return next((x - t for x in self.times if x > t), None)


def _nodes(base: str) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = httpx.get(f"{base}/admin/nodes", timeout=5).json()["nodes"]
    return nodes


async def _round(base: str, workers: list[WorkerProcess], config: FailoverBenchConfig, n: int) -> list[float]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        streams = [TimedStream() for _ in range(config.streams)]
        tasks = [asyncio.create_task(s.run(client, f"round {n} stream {i} goes on", config))
                 for i, s in enumerate(streams)]
        while min(len(s.times) for s in streams) < 5:
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a stream ended before the kill: {[s.error for s in streams if s.error]}")
            await asyncio.sleep(0.02)
        # Asked on the loop, not with a blocking call: a blocked loop would stamp the chunks that piled
        # up meanwhile as arriving after the kill.
        listed = (await client.get("/admin/nodes")).json()["nodes"]
        busy = max(listed, key=lambda node: int(node["in_flight"]))
        victim = next(w for w in workers if w.worker_id == busy["id"])
        killed_at = time.monotonic()
        victim.signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[:3]}")
    waits = sorted((w for s in streams if (w := s.wait_after(killed_at)) is not None), reverse=True)
    interrupted = waits[:int(busy["in_flight"])]
    others = f" (the others: <= {waits[len(interrupted)] * 1000:.0f} ms)" if len(waits) > len(interrupted) else ""
    print(f"round {n}: killed {victim.worker_id} with {busy['in_flight']} of {config.streams} streams; their next "
          f"token after {', '.join(f'{w * 1000:.0f}' for w in sorted(interrupted))} ms{others}")
    return interrupted


def run(config: FailoverBenchConfig) -> dict[str, Any]:
    rounds = min(config.rounds, config.workers - 1)
    pace = ["--synthetic-tokens-per-second", str(config.tokens_per_second), "--synthetic-ttft-ms", str(config.ttft_ms)]
    waits: list[float] = []
    with worker_processes(config.workers, "--driver", "synthetic", *pace) as workers, \
            ServerProcess(["--driver", "fleet", "--workers", ",".join(w.url for w in workers),
                           "--fleet-policy", "least-loaded", "--no-load-shedding"], startup_timeout_s=120) as server:
        for n in range(rounds):
            waits += asyncio.run(_round(server.base_url, workers, config, n))
            deadline = time.monotonic() + 30
            while len(_nodes(server.base_url)) > config.workers - n - 1 and time.monotonic() < deadline:
                time.sleep(0.1)  # the dead worker out of the view before the next round
    ms = [w * 1000 for w in waits]
    target_ms = 1000 + config.ttft_ms
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    print(f"failover, kill -9 to the next token of an interrupted stream ({len(ms)} streams, {rounds} kills): "
          f"p50 {p50:.0f} ms  p99 {p99:.0f} ms  max {max(ms):.0f} ms (target p99 <= {target_ms:.0f} ms: "
          f"{verdict(p99 <= target_ms)})")
    load = print_load_average()
    return {"config": asdict(config), "waits_ms": ms, "p50_ms": p50, "p99_ms": p99, "target_ms": target_ms,
            "met": p99 <= target_ms, "load_average": load}


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_config_command(
        sub, "fleet-failover", "fleet: time from kill -9 of a worker to the next token",
        FailoverBenchConfig(), run, options={
            "workers": "sluice worker processes (one dies per round)",
            "rounds": "kills (at most workers - 1)",
            "streams": "concurrent streams per round",
            "max_tokens": "tokens per stream",
            "tokens_per_second": "synthetic pace per stream",
            "ttft_ms": "synthetic time to first token (one prefill)",
        })
