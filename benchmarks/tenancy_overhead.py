"""What tenancy costs the gateway: requests/s with auth + rate limits + usage records on vs off.

    sluice bench tenants [--requests 2000] [--concurrency 32] [--rounds 3] [--redis-url URL]

Starts two `sluice serve --driver synthetic` processes (unthrottled engine, so the
gateway is the bottleneck): one with `--no-auth`, one with auth on (SQLite in a
temp dir, or PostgreSQL with --database-url; Redis limits with --redis-url) and
a tenant whose limits are checked on every request but never refuse. Rounds
alternate between the two so load from other processes hits both alike; the
best round of each is compared. Target: the cost stays under 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from benchmarks.server_process import ServerProcess

ADMIN_KEY = "bench-admin-key"
BODY = {"messages": [{"role": "user", "content": "hello bench"}], "max_tokens": 8}


# A benchmark of the whole gateway, so it starts servers the way the gateway's own benchmarks do.
@contextmanager
def _server(auth: bool, env: dict[str, str]) -> Iterator[str]:
    options = ["--driver", "synthetic", "--synthetic-tokens-per-second", "0", "--synthetic-ttft-ms", "0",
               "--max-num-seqs", "1024", "--max-waiting", "4096"]
    with ServerProcess(options, startup_timeout_s=60, auth=auth, env=env) as server:
        yield server.base_url


def _tenant_key(base: str) -> str:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    limits = {
        "requests_per_minute": 10_000_000,
        "tokens_per_minute": 1_000_000_000,
        "max_concurrent": 100_000,
    }
    name = f"bench-{time.time_ns()}"
    tenant = httpx.post(f"{base}/admin/tenants", json={"name": name, **limits}, headers=admin).json()
    key = httpx.post(f"{base}/admin/tenants/{tenant['id']}/keys", json={"name": "bench"}, headers=admin)
    secret: str = key.json()["key"]
    return secret


async def _load(base: str, key: str | None, requests: int, concurrency: int) -> float:
    """Requests/s for `requests` chat completions, `concurrency` at a time."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60) as client:
        remaining = iter(range(requests))
        failures = 0

        async def worker() -> None:
            nonlocal failures
            for _ in remaining:
                resp = await client.post("/v1/chat/completions", json=BODY)
                failures += resp.status_code != 200

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"{failures} requests failed")
    return requests / elapsed


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("tenants", help="what auth + rate limits + usage records cost the gateway",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration, alternating")
    parser.add_argument("--redis-url", default=None, help="rate limits in Redis (default: in-process)")
    parser.add_argument("--database-url", default=None, help="tenant database (default: SQLite, temp dir)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as data_dir:
        env = {"SLUICE_ADMIN_KEY": ADMIN_KEY, "SLUICE_DATA_DIR": data_dir}
        env.update({"REDIS_URL": args.redis_url} if args.redis_url else {})
        env.update({"DATABASE_URL": args.database_url} if args.database_url else {})
        with _server(False, env) as off, _server(True, env) as on:
            key = _tenant_key(on)
            warm = max(100, args.requests // 10)
            asyncio.run(_load(off, None, warm, args.concurrency))
            asyncio.run(_load(on, key, warm, args.concurrency))
            results: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.rounds):
                results["off"].append(asyncio.run(_load(off, None, args.requests, args.concurrency)))
                results["on"].append(asyncio.run(_load(on, key, args.requests, args.concurrency)))
    best_off, best_on = max(results["off"]), max(results["on"])
    cost = 1 - best_on / best_off
    backend = "redis" if args.redis_url else "in-process"
    database = "postgresql" if args.database_url else "sqlite"
    print(
        f"gateway requests/s, synthetic driver, {args.requests} requests x {args.rounds} rounds, c={args.concurrency}"
    )
    print(
        f"  auth off                              : {best_off:8.1f} req/s  (rounds: {_fmt(results['off'])})"
    )
    print(
        f"  auth + limits ({backend}) + usage ({database}): {best_on:8.1f} req/s  (rounds: {_fmt(results['on'])})"
    )
    print(f"  cost: {cost * 100:.1f}% (target < 10%)")
    return 0


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)
