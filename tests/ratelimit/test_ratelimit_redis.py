"""What only the shared backend has: replicas in separate processes, key expiry, outages."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time

import pytest
import redis
from prometheus_client import CollectorRegistry
from ratelimit_support import HANG_S, REDIS_URL, PrivateRedis, admit_many_in_process, wait_until

from ratelimit.base import FailMode, Reservation, TenantLimits
from ratelimit.redis_backend import RedisRateLimiter
from ratelimit.registry import create_rate_limiter


def test_two_processes_sharing_redis_admit_exactly_n(redis_prefix: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)  # both processes fire together, once imported and connected
    out = ctx.Queue()
    procs = [
        ctx.Process(target=admit_many_in_process, args=(redis_prefix, f"p{i}", 25, start, out))
        for i in range(2)
    ]
    for proc in procs:
        proc.start()
    allowed = [out.get(timeout=HANG_S) for _ in procs]
    for proc in procs:
        proc.join(HANG_S)
        assert proc.exitcode == 0
    assert sum(allowed) == 10, allowed


def test_keys_expire_when_buckets_would_be_full(redis_prefix: str) -> None:
    async def main() -> None:
        limiter = RedisRateLimiter(REDIS_URL, key_prefix=redis_prefix, lease_s=5)
        limits = TenantLimits(requests_per_minute=60, tokens_per_minute=600, max_concurrent=3)
        assert (await limiter.admit("t", "r1", limits, 300)).allowed
        assert (await limiter.admit("t", "r2", limits, 0, sequences=2)).allowed
        await limiter.release(Reservation("t", "early", 0, limits), 0)  # before its admit: a tombstone
        await limiter.close()

    started = time.monotonic()
    asyncio.run(main())
    client = redis.Redis.from_url(REDIS_URL)
    base = f"{redis_prefix}{{t}}"
    ttl = {kind: client.pttl(f"{base}:{kind}") for kind in ("req", "tok", "flight", "seqs", "done")}
    # However long the test took since the keys were written, they expired no earlier than that.
    taken_ms = (time.monotonic() - started) * 1000
    # requests: 2 of 60 at 1/s -> full in 2 s; tokens: 300 of 600 at 10/s -> 30 s; lease 5 s. (+1 s margin)
    for kind, full_ms in (("req", 3000), ("tok", 31000), ("flight", 6000), ("seqs", 6000), ("done", 6000)):
        assert full_ms - taken_ms < ttl[kind] <= full_ms, (kind, ttl)
    assert client.zcard(f"{base}:flight") == 2
    assert client.hgetall(f"{base}:seqs") == {b"r2": b"2"}  # one-sequence leases need no entry
    client.close()


def test_registry_picks_the_backend(redis_prefix: str) -> None:
    async def main() -> None:
        shared = create_rate_limiter(REDIS_URL, FailMode.CLOSED, key_prefix=redis_prefix, lease_s=5)
        assert isinstance(shared, RedisRateLimiter) and shared.fail_mode is FailMode.CLOSED
        await shared.close()
        local = create_rate_limiter(None, timeout_s=0.1, lease_s=5)
        assert type(local).__name__ == "InProcessRateLimiter"
        with pytest.raises(TypeError):
            create_rate_limiter(None, leese_s=5)

    asyncio.run(main())


def test_outage_follows_fail_mode_logs_once_and_recovers(
    spare_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    limits = TenantLimits(requests_per_minute=100, max_concurrent=10)
    registry = CollectorRegistry()

    async def main() -> None:
        open_ = RedisRateLimiter(spare_redis.url, FailMode.OPEN, timeout_s=0.2, registry=registry)
        closed = RedisRateLimiter(spare_redis.url, FailMode.CLOSED, timeout_s=0.2)
        held = await open_.admit("t", "r0", limits, 1)
        assert held.allowed and not held.degraded and held.reservation is not None
        assert (await closed.admit("t", "r1", limits, 1)).allowed

        spare_redis.kill()
        for i in range(3):
            degraded = await open_.admit("t", f"o{i}", limits, 1)
            assert degraded.allowed and degraded.degraded and degraded.reservation is not None
            refused = await closed.admit("t", f"c{i}", limits, 1)
            assert not refused.allowed and refused.degraded
            assert refused.refused_by == "unavailable" and refused.retry_after_s == 1.0
        await open_.release(held.reservation, 1)  # must not raise; retried in the background
        assert open_.releases_pending == 1
        assert registry.get_sample_value("ratelimit_backend_errors_total", {"operation": "admit"}) == 3
        release_errors = registry.get_sample_value("ratelimit_backend_errors_total", {"operation": "release"})
        assert release_errors is not None and release_errors >= 1
        assert open_.backend_errors >= 4 and closed.backend_errors >= 3  # + retries in the background
        # Fail-closed admissions may have charged before the answer was lost: rolled back by id.
        assert closed.releases_pending == 3
        warnings = [
            r for r in caplog.records if r.name == "sluice.ratelimit" and r.levelno == logging.WARNING
        ]
        assert len(warnings) == 2  # one per limiter per outage, not one per call
        assert warnings[0].__dict__["backend"] == "redis"

        spare_redis.start()  # a fresh, empty Redis on the same port: scripts reload by themselves
        back = await open_.admit("t", "r2", limits, 1)
        assert back.allowed and not back.degraded
        assert back.headers["x-ratelimit-remaining-requests"] == "99"
        assert (await closed.admit("t", "r3", limits, 1)).allowed
        recovered = [r for r in caplog.records if r.name == "sluice.ratelimit" and r.levelno == logging.INFO]
        assert len(recovered) == 2
        await wait_until(lambda: open_.releases_pending == closed.releases_pending == 0, "retries landed")

        # A hung Redis (paused process) is an outage too, bounded by timeout_s (a hang fails here).
        spare_redis.pause()
        async with asyncio.timeout(HANG_S):
            hung = await closed.admit("t", "r4", limits, 1)
        assert hung.refused_by == "unavailable"
        spare_redis.resume()
        await open_.close()
        await closed.close()

    with caplog.at_level(logging.INFO, logger="sluice.ratelimit"):
        asyncio.run(main())
