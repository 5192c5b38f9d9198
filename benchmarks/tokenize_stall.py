"""`sluice bench stall`: how long running streams stall while a huge prompt arrives.

Starts a real `sluice serve` (native driver, the bundled model, `--no-auth`, a body cap of 4 MiB so
that a 1 MiB prompt gets as far as tokenization, no load shedding) through `ServerProcess`; this
process is the client. Each round opens 8 streaming completions (greedy, ignore_eos, long enough to
outlast the round), waits until every one is decoding, then measures two windows, in alternating
order from round to round so that drift hits both alike:

    (a) quiet       nothing else arrives, for `window_s`
    (b) big prompt  a completion whose prompt is ~1 MiB of words is sent at the window's start; the
                    server refuses it (400/413: longer than the context), and what it costs the others
                    before that is what is measured; the window lasts `window_s`, or until the refusal
                    came back plus `settle_s` if that is later

Figure of a window: the largest gap between two consecutive chunks of any of the 8 streams that ends
inside it. Between windows the streams settle for `settle_s`, so a stall cannot spill into the next.
It prints each round, the largest gap of (a) and of (b) over all rounds, the ratio (b)/(a) (target
<= 1.5x), the big request's status and time, and the load average. Wall-clock figures on a shared
machine: compare runs made under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from benchmarks.server_process import ServerProcess
from benchmarks.sse_lines import sse_lines
from benchmarks.words import WORDS

TARGET_RATIO = 1.5
_STREAM_PROMPT = "Write a very long story about a lighthouse keeper and the sea."


@dataclass(frozen=True)
class StallConfig:
    streams: int = 8
    rounds: int = 4  # at least 2: each phase comes first once
    window_s: float = 3.0
    settle_s: float = 0.5
    prompt_bytes: int = 1 << 20
    max_body_bytes: int = 4 << 20
    max_tokens: int = 2048  # per stream; streams are closed at the end of each round
    num_threads: int = 1  # a shared 2-core host: two OpenMP threads stall each other for seconds
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class RoundResult:
    order: str  # "quiet, big" or "big, quiet"
    quiet_max_gap_ms: float
    quiet_median_gap_ms: float
    big_max_gap_ms: float
    big_window_s: float
    big_status: int
    big_response_ms: float
    streams_alive: int  # streams still decoding at the end of the round (all, or the figures miss some)


def big_prompt_body(model: str, size: int) -> bytes:
    """A completion request whose prompt is `size` bytes of words, encoded once before any window."""
    rng = random.Random(0)
    words: list[str] = []
    length = 0
    while length < size:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return json.dumps({"model": model, "prompt": " ".join(words), "max_tokens": 1}).encode()


def gaps_ending_in(times: list[list[float]], start: float, end: float) -> list[float]:
    return [b - a for ts in times for a, b in itertools.pairwise(ts) if start <= b <= end]


async def _stream(client: httpx.AsyncClient, model: str, config: StallConfig, times: list[float]) -> None:
    body = {"model": model, "prompt": _STREAM_PROMPT, "max_tokens": config.max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"stream refused: {response.status_code} {(await response.aread())[:200]!r}")
        async for line in sse_lines(response):
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]" and json.loads(data).get("choices"):
                times.append(time.perf_counter())


async def _send_big(base_url: str, body: bytes) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        start = time.perf_counter()
        headers = {"content-type": "application/json"}
        response = await client.post("/v1/completions", content=body, headers=headers)
        return response.status_code, time.perf_counter() - start


async def _wait_decoding(times: list[list[float]], tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(len(ts) >= 4 for ts in times):
        for task in tasks:
            if task.done():
                task.result()  # raises what ended it
                raise RuntimeError("a stream ended before the windows began")
        if time.monotonic() > deadline:
            raise RuntimeError(f"streams not decoding after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def one_round(
    base_url: str, model: str, config: StallConfig, big_body: bytes, big_first: bool
) -> RoundResult:
    times: list[list[float]] = [[] for _ in range(config.streams)]
    limits = httpx.Limits(max_connections=config.streams)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, model, config, ts)) for ts in times]
        try:
            await _wait_decoding(times, tasks, config.startup_timeout_s)
            figures: dict[str, Any] = {}
            for phase in ("big", "quiet") if big_first else ("quiet", "big"):
                start = time.perf_counter()
                if phase == "quiet":
                    await asyncio.sleep(config.window_s)
                    gaps = gaps_ending_in(times, start, time.perf_counter())
                    figures["quiet_max_gap_ms"] = max(gaps, default=0.0) * 1000
                    figures["quiet_median_gap_ms"] = statistics.median(gaps) * 1000 if gaps else 0.0
                else:
                    status, elapsed = await _send_big(base_url, big_body)
                    await asyncio.sleep(max(config.settle_s, start + config.window_s - time.perf_counter()))
                    end = time.perf_counter()
                    gaps = gaps_ending_in(times, start, end)
                    figures.update(big_max_gap_ms=max(gaps, default=0.0) * 1000, big_window_s=end - start,
                                   big_status=status, big_response_ms=elapsed * 1000)
                await asyncio.sleep(config.settle_s)
            alive = sum(not task.done() for task in tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return RoundResult(order="big, quiet" if big_first else "quiet, big", streams_alive=alive, **figures)


async def _first_model(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return str((await client.get("/v1/models")).json()["data"][0]["id"])


def run(config: StallConfig) -> dict[str, Any]:
    if config.rounds < 2:
        raise SystemExit("--rounds must be at least 2: each phase comes first once")
    options = ["--driver", "native", "--num-threads", str(config.num_threads),
               "--max-body-bytes", str(config.max_body_bytes), "--no-load-shedding"]
    load_start = os.getloadavg()
    rounds = []
    with ServerProcess(options, startup_timeout_s=config.startup_timeout_s) as server:
        model = asyncio.run(_first_model(server.base_url))
        big_body = big_prompt_body(model, config.prompt_bytes)
        for r in range(config.rounds):
            result = asyncio.run(one_round(server.base_url, model, config, big_body, big_first=r % 2 == 1))
            rounds.append(result)
            print(f"round {r} ({result.order}): largest gap quiet {result.quiet_max_gap_ms:7.1f} ms "
                  f"(median {result.quiet_median_gap_ms:5.1f}), "
                  f"with the big prompt {result.big_max_gap_ms:7.1f} ms; "
                  f"big prompt -> {result.big_status} in {result.big_response_ms:.0f} ms; "
                  f"{result.streams_alive}/{config.streams} streams alive", flush=True)
    quiet = max(r.quiet_max_gap_ms for r in rounds)
    big = max(r.big_max_gap_ms for r in rounds)
    ratio = big / quiet if quiet > 0 else float("inf")
    summary = {
        "config": asdict(config),
        "rounds": [asdict(r) for r in rounds],
        "quiet_max_gap_ms": quiet,
        "big_prompt_max_gap_ms": big,
        "ratio_big_over_quiet": ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }
    print(f"largest inter-chunk gap of {config.streams} streams over {config.rounds} rounds: "
          f"(a) quiet {quiet:.1f} ms, (b) while a {config.prompt_bytes / 2**20:.2f} MiB prompt arrives "
          f"{big:.1f} ms")
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"ratio (b)/(a): {ratio:.2f}x (target <= {TARGET_RATIO}x) -> {verdict}")
    print(f"load average (1/5/15 min): start {load_start}, end {summary['load_average_end']}")
    return summary


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stall", help="largest gap of 8 streams while a 1 MiB prompt arrives vs quiet",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = StallConfig()
    p.add_argument("--streams", type=int, default=d.streams, help=f"decoding streams (default {d.streams})")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help=f"alternating rounds, >= 2 (default {d.rounds})")
    p.add_argument("--window", type=float, default=d.window_s,
                   help=f"seconds per window (default {d.window_s})")
    p.add_argument("--prompt-bytes", type=int, default=d.prompt_bytes,
                   help=f"size of the big prompt (default {d.prompt_bytes})")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"the server's body cap (default {d.max_body_bytes})")
    p.add_argument("--num-threads", type=int, default=d.num_threads,
                   help=f"engine torch threads (default {d.num_threads})")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = StallConfig(streams=args.streams, rounds=args.rounds, window_s=args.window,
                         prompt_bytes=args.prompt_bytes, max_body_bytes=args.max_body_bytes,
                         num_threads=args.num_threads)
    summary = run(config)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
