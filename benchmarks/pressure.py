"""What the scheduling-under-pressure benchmarks share (`sluice bench priority | prefix | spike`, each in a
module of its own): the server options they start with, one streaming chat request seen from the client,
a percentile, and the report (figures, load average, optional JSON). No engine import here: they measure
real `sluice serve` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import httpx

from benchmarks.sse_lines import sse_lines


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-threads", type=int, default=2, help="engine torch threads")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of the server")
    p.add_argument("--json-out", default=None, help="also write the figures as JSON")


def server_options(args: argparse.Namespace) -> list[str]:
    return [
        "--driver",
        "native",
        "--num-threads",
        str(args.num_threads),
        "--kv-cache-memory",
        args.kv_cache_memory,
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
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
        async for line in sse_lines(resp):
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


def report(name: str, figures: dict[str, Any], json_out: str | None) -> None:
    figures = {**figures, "load_average": os.getloadavg()}
    print(f"== {name} ==")
    for key, value in figures.items():
        print(f"  {key:<34}{value:.3f}" if isinstance(value, float) else f"  {key:<34}{value}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(figures, f, indent=2)
