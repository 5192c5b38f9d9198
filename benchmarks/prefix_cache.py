"""`sluice bench prefix`: a shared ~1,000-token system prompt, TTFT and throughput with the prefix cache on
vs off (one `sluice serve` each); prints both and the ratios (targets: TTFT >= 5x lower, throughput >= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import httpx

from benchmarks.pressure import add_common_arguments, report, server_options, stream_chat
from benchmarks.server_process import ServerProcess
from benchmarks.words import WORDS


def _system_prompt(words: int) -> str:
    rng = random.Random(7)
    return "You are a helpful assistant. Context: " + " ".join(rng.choice(WORDS) for _ in range(words))


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
        ttfts = [(await stream_chat(client, body(i)))["ttft"] for i in range(args.samples)]
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> dict[str, Any]:
            async with gate:
                return await stream_chat(client, body(100 + i))

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
    base = [*server_options(args), "--max-model-len", "2048", "--max-num-seqs", str(args.concurrency)]
    for label, extra in (("on", []), ("off", ["--no-prefix-caching"])):
        with ServerProcess([*base, *extra]) as server:
            for key, value in asyncio.run(_prefix(server.base_url, args)).items():
                figures[f"cache_{label}_{key}"] = value
    figures["ttft_ratio_off_over_on"] = figures["cache_off_ttft_p50_ms"] / figures["cache_on_ttft_p50_ms"]
    figures["throughput_ratio_on_over_off"] = (
        figures["cache_on_requests_per_s"] / figures["cache_off_requests_per_s"]
    )
    figures["targets"] = "TTFT >= 5x lower, throughput >= 2x higher with the cache on"
    report("prefix cache: shared system prompt, cache on vs off", figures, args.json_out)
    return 0


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("prefix", help="shared system prompt: prefix cache on vs off", formatter_class=fmt)
    add_common_arguments(p)
    p.add_argument(
        "--system-words", type=int, default=970, help="words of the shared system prompt (~1,000 tokens)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--samples", type=int, default=6, help="sequential requests for TTFT")
    p.add_argument("--requests", type=int, default=24, help="requests of the throughput run")
    p.add_argument("--concurrency", type=int, default=8, help="in flight during the throughput run")
    p.set_defaults(func=_run_prefix)
