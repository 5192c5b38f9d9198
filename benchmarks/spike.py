"""`sluice bench spike`: N streaming requests at once against a real `sluice serve`: % completed, % refused
with Retry-After (by tier and by which check refused), peak RSS of the gateway and engine processes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

import httpx

from benchmarks.pressure import add_common_arguments, report, server_options, stream_chat
from benchmarks.server_process import ServerProcess


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
                r = await stream_chat(client, body)
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
        *server_options(args),
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
    report(f"spike: {n} streaming requests at once", figures, args.json_out)
    return 0 if figures["sum_pct"] == 100.0 else 1


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser(
        "spike", help="N streaming requests at once: completed / refused / RSS", formatter_class=fmt
    )
    add_common_arguments(p)
    p.add_argument("--requests", type=int, default=2000, help="requests submitted at once")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=32, help="running cap of the server")
    p.add_argument("--max-waiting", type=int, default=128, help="waiting-queue bound of the server")
    p.set_defaults(func=_run_spike)
