"""Admission latency: the in-process limiter against the Redis one, in one process.

    sluice bench ratelimit [--n 2000] [--redis-url redis://127.0.0.1:6379/15]

Each admission is awaited alone (the latency a request sees before dispatch),
then released, over 100 tenants with limits high enough that every one passes,
so every call runs the full script. Target: p99 < 2 ms against a local Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis

from ratelimit.base import RateLimiter, TenantLimits
from ratelimit.memory import InProcessRateLimiter
from ratelimit.redis_backend import RedisRateLimiter

LIMITS = TenantLimits(requests_per_minute=10**7, tokens_per_minute=10**9, max_concurrent=10**6)


async def measure(limiter: RateLimiter, n: int, warmup: int = 200) -> tuple[list[float], list[float]]:
    """Milliseconds per admit and per release, `n` of each after `warmup` untimed ones."""
    admits: list[float] = []
    releases: list[float] = []
    for i in range(warmup + n):
        tenant = f"tenant-{i % 100}"
        started = time.perf_counter()
        admission = await limiter.admit(tenant, f"req-{i}", LIMITS, 1200)
        admitted = time.perf_counter()
        assert admission.allowed and admission.reservation is not None and not admission.degraded
        await limiter.release(admission.reservation, 300)
        released = time.perf_counter()
        if i >= warmup:
            admits.append((admitted - started) * 1000)
            releases.append((released - admitted) * 1000)
    return admits, releases


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(name: str, what: str, values: list[float]) -> None:
    print(
        f"{name:<12} {what:<8} p50 {percentile(values, 0.50):7.3f} ms   p99 {percentile(values, 0.99):7.3f} ms"
        f"   mean {statistics.fmean(values):7.3f} ms"
    )


async def compare(n: int, redis_url: str) -> None:
    prefix = f"sluice:bench:{uuid.uuid4().hex[:8]}:"
    memory_admits, memory_releases = await measure(InProcessRateLimiter(), n)
    limiter = RedisRateLimiter(redis_url, key_prefix=prefix, timeout_s=1.0)
    try:
        redis_admits, redis_releases = await measure(limiter, n)
    finally:
        await limiter.close()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    print(f"{n} admissions + releases each, one at a time, 100 tenants")
    report("in-process", "admit", memory_admits)
    report("in-process", "release", memory_releases)
    report("redis", "admit", redis_admits)
    report("redis", "release", redis_releases)
    ratio = percentile(redis_admits, 0.5) / percentile(memory_admits, 0.5)
    print(f"redis / in-process admit p50: {ratio:.0f}x")


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ratelimit", help="admission latency: in-process limiter vs Redis",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    asyncio.run(compare(args.n, args.redis_url))
    return 0
