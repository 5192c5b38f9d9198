"""`sluice bench priority`: tier-0 TTFT with the engine saturated by tier-2 streams vs on an idle engine,
through a real `sluice serve`; prints the figures and the ratio saturated p99 / idle p50 (target <= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx

from benchmarks.pressure import add_common_arguments, percentile, report, server_options, stream_chat
from benchmarks.server_process import ServerProcess


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

        await stream_chat(client, high(-1))  # warm-up
        idle = [(await stream_chat(client, high(i)))["ttft"] for i in range(args.samples)]
        low_body = {
            "messages": [{"role": "user", "content": "Tell me a long story about a river."}],
            "max_tokens": args.low_max_tokens,
            "ignore_eos": True,
            "priority": 2,
        }
        background = [asyncio.create_task(stream_chat(client, low_body)) for _ in range(args.background)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # saturated: the running cap is full and work queues
            stats = (await client.get("/v1/engine/stats")).json()
            if stats["running"] >= args.max_num_seqs and stats["waiting"] > 0:
                break
            await asyncio.sleep(0.2)
        saturated_at = (await client.get("/v1/engine/stats")).json()
        loaded = []
        for i in range(args.samples):
            loaded.append((await stream_chat(client, high(1000 + i)))["ttft"])
            await asyncio.sleep(0.2)
        after = (await client.get("/v1/engine/stats")).json()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    idle_p50, loaded_p99 = statistics.median(idle), percentile(loaded, 99)
    return {
        "background_tier2_streams": args.background,
        "running_cap": args.max_num_seqs,
        "running_waiting_when_measured": f"{saturated_at['running']} / {saturated_at['waiting']}",
        "preemptions_during": after["preemptions"] - saturated_at["preemptions"],
        "tier0_ttft_idle_p50_ms": idle_p50 * 1000,
        "tier0_ttft_idle_p99_ms": percentile(idle, 99) * 1000,
        "tier0_ttft_saturated_p50_ms": statistics.median(loaded) * 1000,
        "tier0_ttft_saturated_p99_ms": loaded_p99 * 1000,
        "ratio_saturated_p99_over_idle_p50": loaded_p99 / idle_p50,
        "target": "<= 2x",
    }


def _run_priority(args: argparse.Namespace) -> int:
    options = [
        *server_options(args),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        "1024",
        "--no-load-shedding",
    ]
    with ServerProcess(options) as server:
        figures = asyncio.run(_priority(server.base_url, args))
    report("priority: tier-0 TTFT, engine saturated by tier-2 streams vs idle", figures, args.json_out)
    return 0


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("priority", help="tier-0 TTFT under tier-2 saturation vs idle", formatter_class=fmt)
    add_common_arguments(p)
    p.add_argument("--max-num-seqs", type=int, default=8, help="running cap of the server")
    p.add_argument("--background", type=int, default=24, help="tier-2 streams that saturate the engine")
    p.add_argument("--low-max-tokens", type=int, default=256, help="length of each tier-2 stream")
    p.add_argument("--samples", type=int, default=10, help="tier-0 requests measured, idle and loaded")
    p.set_defaults(func=_run_priority)
