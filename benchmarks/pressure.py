"""Scheduling under pressure, measured through real `sluice serve` processes (no engine import here):

    sluice bench priority   tier-0 TTFT with the engine saturated by tier-2 streams vs on an idle engine
    sluice bench prefix     a shared 1,000-token system prompt: TTFT and throughput, prefix cache on vs off
    sluice bench spike      N streaming requests at once: % completed, % refused with Retry-After, peak RSS

Each prints its figures and ratios from one run, with the load average, and can write JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections import Counter
from typing import Any

import httpx

from benchmarks.server_process import ServerProcess

_WORDS = [
    "river",
    "stone",
    "light",
    "cloud",
    "garden",
    "window",
    "paper",
    "music",
    "forest",
    "winter",
    "harbor",
    "signal",
    "market",
    "bridge",
    "candle",
    "silver",
    "orchard",
    "meadow",
    "lantern",
    "canyon",
]


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "--driver",
        "native",
        "--num-threads",
        str(args.num_threads),
        "--kv-cache-memory",
        args.kv_cache_memory,
    ]


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming chat request: status, TTFT (first content delta), tokens, end-to-end time."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    done = False
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            try:
                message = str(resp.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                message = resp.text[:80]
            return {
                "status": resp.status_code,
                "retry_after": resp.headers.get("retry-after"),
                "message": message,
            }
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content") is not None or choice.get("finish_reason"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += 1 if choice.get("delta", {}).get("content") else 0
    return {"status": 200, "ttft": ttft, "tokens": tokens, "e2e": time.perf_counter() - start, "done": done}


def _report(name: str, figures: dict[str, Any], json_out: str | None) -> None:
    figures = {**figures, "load_average": os.getloadavg()}
    print(f"== {name} ==")
    for key, value in figures.items():
        print(f"  {key:<34}{value:.3f}" if isinstance(value, float) else f"  {key:<34}{value}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(figures, f, indent=2)


# -- priority ------------------------------------------------------------------------------------


async def _priority(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.background + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        def high(i: int) -> dict[str, Any]:
            return {
                "messages": [{"role": "user", "content": f"Name a colour ({i})."}],
                "max_tokens": 4,
                "priority": 0,
                "temperature": 0,
            }

        await _stream(client, high(-1))  # warm-up
        idle = [(await _stream(client, high(i)))["ttft"] for i in range(args.samples)]
        low_body = {
            "messages": [{"role": "user", "content": "Tell me a long story about a river."}],
            "max_tokens": args.low_max_tokens,
            "ignore_eos": True,
            "priority": 2,
        }
        background = [asyncio.create_task(_stream(client, low_body)) for _ in range(args.background)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # saturated: the running cap is full and work queues
            stats = (await client.get("/v1/engine/stats")).json()
            if stats["running"] >= args.max_num_seqs and stats["waiting"] > 0:
                break
            await asyncio.sleep(0.2)
        saturated_at = (await client.get("/v1/engine/stats")).json()
        loaded = []
        for i in range(args.samples):
            loaded.append((await _stream(client, high(1000 + i)))["ttft"])
            await asyncio.sleep(0.2)
        after = (await client.get("/v1/engine/stats")).json()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    idle_p50, loaded_p99 = statistics.median(idle), _p(loaded, 99)
    return {
        "background_tier2_streams": args.background,
        "running_cap": args.max_num_seqs,
        "running_waiting_when_measured": f"{saturated_at['running']} / {saturated_at['waiting']}",
        "preemptions_during": after["preemptions"] - saturated_at["preemptions"],
        "tier0_ttft_idle_p50_ms": idle_p50 * 1000,
        "tier0_ttft_idle_p99_ms": _p(idle, 99) * 1000,
        "tier0_ttft_saturated_p50_ms": statistics.median(loaded) * 1000,
        "tier0_ttft_saturated_p99_ms": loaded_p99 * 1000,
        "ratio_saturated_p99_over_idle_p50": loaded_p99 / idle_p50,
        "target": "<= 2x",
    }


def _run_priority(args: argparse.Namespace) -> int:
    options = [
        *_common(args),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        "1024",
        "--no-load-shedding",
    ]
    with ServerProcess(options) as server:
        figures = asyncio.run(_priority(server.base_url, args))
    _report("priority: tier-0 TTFT, engine saturated by tier-2 streams vs idle", figures, args.json_out)
    return 0


# -- prefix cache --------------------------------------------------------------------------------


def _system_prompt(words: int) -> str:
    rng = random.Random(7)
    return "You are a helpful assistant. Context: " + " ".join(rng.choice(_WORDS) for _ in range(words))


async def _prefix(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    system = _system_prompt(args.system_words)

    def body(i: int) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: which word comes first?"},
            ],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        first = await client.post("/v1/chat/completions", json={**body(-1), "max_tokens": 1})
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        ttfts = [(await _stream(client, body(i)))["ttft"] for i in range(args.samples)]
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> dict[str, Any]:
            async with gate:
                return await _stream(client, body(100 + i))

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(args.requests)))
        duration = time.perf_counter() - start
        stats = (await client.get("/v1/engine/stats")).json()
    ok = [r for r in results if r["status"] == 200]
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / duration,
        "failed": len(results) - len(ok),
        "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
    }


def _run_prefix(args: argparse.Namespace) -> int:
    figures: dict[str, Any] = {}
    base = [*_common(args), "--max-model-len", "2048", "--max-num-seqs", str(args.concurrency)]
    for label, extra in (("on", []), ("off", ["--no-prefix-caching"])):
        with ServerProcess([*base, *extra]) as server:
            for key, value in asyncio.run(_prefix(server.base_url, args)).items():
                figures[f"cache_{label}_{key}"] = value
    figures["ttft_ratio_off_over_on"] = figures["cache_off_ttft_p50_ms"] / figures["cache_on_ttft_p50_ms"]
    figures["throughput_ratio_on_over_off"] = (
        figures["cache_on_requests_per_s"] / figures["cache_off_requests_per_s"]
    )
    figures["targets"] = "TTFT >= 5x lower, throughput >= 2x higher with the cache on"
    _report("prefix cache: shared system prompt, cache on vs off", figures, args.json_out)
    return 0


# -- spike ---------------------------------------------------------------------------------------


async def _spike(base_url: str, args: argparse.Namespace) -> tuple[Counter[str], float]:
    limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def one(i: int) -> str:
            body = {
                "messages": [{"role": "user", "content": f"Say a word about {i}."}],
                "max_tokens": args.max_tokens,
                "priority": i % 3,
            }
            try:
                r = await _stream(client, body)
            except httpx.HTTPError as exc:
                return f"transport error {type(exc).__name__}"
            if r["status"] == 200:
                return f"completed (tier {i % 3})" if r["done"] else "incomplete stream"
            if r["status"] in (429, 503) and r.get("retry_after"):
                reason = " ".join(r["message"].split()[:3])  # which check refused it
                return f"refused {r['status']} with Retry-After (tier {i % 3}): {reason}..."
            return f"other {r['status']}"

        start = time.perf_counter()
        outcomes = Counter(await asyncio.gather(*(one(i) for i in range(args.requests))))
        return outcomes, time.perf_counter() - start


def _run_spike(args: argparse.Namespace) -> int:
    options = [
        *_common(args),
        "--max-model-len",
        "256",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-waiting",
        str(args.max_waiting),
    ]
    with ServerProcess(options) as server:
        rss_before = sum(server.peak_rss_bytes().values())
        outcomes, duration = asyncio.run(_spike(server.base_url, args))
        idle = server.wait_idle()
        peaks = server.peak_rss_bytes()
    n = args.requests
    completed = sum(v for k, v in outcomes.items() if k.startswith("completed"))
    refused = sum(v for k, v in outcomes.items() if k.startswith("refused"))
    figures: dict[str, Any] = {
        "requests": n,
        "duration_s": duration,
        "completed_pct": 100.0 * completed / n,
        "refused_with_retry_after_pct": 100.0 * refused / n,
        "sum_pct": 100.0 * (completed + refused) / n,
        "outcomes": dict(sorted(outcomes.items())),
        "peak_rss_mib_by_process": {pid: round(b / 2**20, 1) for pid, b in peaks.items()},
        "peak_rss_mib_total": sum(peaks.values()) / 2**20,
        "peak_rss_mib_total_at_start": rss_before / 2**20,
        "kv_blocks_used_when_idle": idle["kv_blocks_used"],
    }
    _report(f"spike: {n} streaming requests at once", figures, args.json_out)
    return 0 if figures["sum_pct"] == 100.0 else 1


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--num-threads", type=int, default=2, help="engine torch threads")
        p.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of the server")
        p.add_argument("--json-out", default=None, help="also write the figures as JSON")

    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("priority", help="tier-0 TTFT under tier-2 saturation vs idle", formatter_class=fmt)
    common(p)
    p.add_argument("--max-num-seqs", type=int, default=8, help="running cap of the server")
    p.add_argument("--background", type=int, default=24, help="tier-2 streams that saturate the engine")
    p.add_argument("--low-max-tokens", type=int, default=256, help="length of each tier-2 stream")
    p.add_argument("--samples", type=int, default=10, help="tier-0 requests measured, idle and loaded")
    p.set_defaults(func=_run_priority)

    p = sub.add_parser("prefix", help="shared system prompt: prefix cache on vs off", formatter_class=fmt)
    common(p)
    p.add_argument(
        "--system-words", type=int, default=970, help="words of the shared system prompt (~1,000 tokens)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--samples", type=int, default=6, help="sequential requests for TTFT")
    p.add_argument("--requests", type=int, default=24, help="requests of the throughput run")
    p.add_argument("--concurrency", type=int, default=8, help="in flight during the throughput run")
    p.set_defaults(func=_run_prefix)

    p = sub.add_parser(
        "spike", help="N streaming requests at once: completed / refused / RSS", formatter_class=fmt
    )
    common(p)
    p.add_argument("--requests", type=int, default=2000, help="requests submitted at once")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=32, help="running cap of the server")
    p.add_argument("--max-waiting", type=int, default=128, help="waiting-queue bound of the server")
    p.set_defaults(func=_run_spike)
