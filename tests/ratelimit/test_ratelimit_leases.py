"""Every admit ends in exactly one release, whatever Redis does: nothing stays held after a fault.

A lease that nobody releases holds its concurrency slots and tokens until it expires (minutes);
a tenant at its cap gets 429 on every request all that time. These tests lose Redis' answers
on purpose, through a proxy that holds replies back or a redis-server that is SIGSTOPped, and
then look at Redis itself: no lease may be left, and the tenant is admitted at full capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from ratelimit_support import REDIS_URL, PrivateRedis, RedisProxy, wait_until

from ratelimit.base import Admission, FailMode, TenantLimits
from ratelimit.redis_backend import RedisRateLimiter

# Short, so that the calls Redis cannot answer give up quickly; no assertion depends on it.
TIMEOUT_S = 0.1


async def leases(url: str, prefix: str, tenant: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return int(await client.zcard(f"{prefix}{{{tenant}}}:flight"))
    finally:
        await client.aclose()


def no_lease_left(url: str, prefix: str, tenant: str = "t") -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await leases(url, prefix, tenant) == 0

    return check


async def through_proxy(body: Callable[[RedisProxy], Awaitable[None]]) -> None:
    proxy = RedisProxy()
    await proxy.start()
    try:
        await body(proxy)
    finally:
        await proxy.close()


async def connected(limiter: RedisRateLimiter) -> None:
    """Connect and load the scripts first, so that holding replies holds the admission's own reply."""
    warm = await limiter.admit("warm-up", "w", TenantLimits(max_concurrent=1), 0)
    assert warm.allowed and not warm.degraded and warm.reservation is not None
    await limiter.release(warm.reservation, 0)


def test_admit_whose_reply_is_lost_after_the_script_ran_holds_nothing(redis_prefix: str) -> None:
    """Fail-closed: the admit times out after Redis charged it, and is refused; the charge must go."""
    limits = TenantLimits(tokens_per_minute=1000, max_concurrent=1)

    async def body(proxy: RedisProxy) -> None:
        limiter = RedisRateLimiter(proxy.url(), FailMode.CLOSED, key_prefix=redis_prefix, timeout_s=TIMEOUT_S)
        try:
            await connected(limiter)
            proxy.hold_replies()
            lost = await limiter.admit("t", "r1", limits, 600)
            assert not lost.allowed and lost.refused_by == "unavailable"
            await wait_until(lambda: proxy.replies_held >= 1, "Redis answered the admission (its script ran)")
            proxy.flow()
            await wait_until(no_lease_left(REDIS_URL, redis_prefix), "the lost admission's lease is gone")
            whole = await limiter.admit("t", "r2", limits, 1000)  # the slot and every token
            assert whole.allowed and not whole.degraded, whole
            assert whole.headers["x-ratelimit-remaining-tokens"] == "0"
        finally:
            await limiter.close()

    asyncio.run(through_proxy(body))


def test_admit_that_reaches_redis_after_its_rollback_charges_nothing(redis_prefix: str) -> None:
    """Fail-closed: the admit is stuck on its way, times out and is rolled back on another
    connection; only then does it reach Redis and run. It must charge nothing."""
    limits = TenantLimits(tokens_per_minute=1000, max_concurrent=1)

    async def body(proxy: RedisProxy) -> None:
        limiter = RedisRateLimiter(proxy.url(), FailMode.CLOSED, key_prefix=redis_prefix, timeout_s=TIMEOUT_S)
        try:
            await connected(limiter)
            proxy.stall_open_connections()  # the pooled connection the admit will use
            lost = await limiter.admit("t", "r1", limits, 600)
            assert not lost.allowed and lost.refused_by == "unavailable"
            await wait_until(lambda: limiter.releases_pending == 0, "the rollback reached Redis")
            proxy.flow()
            await proxy.stalled_ended()  # the admit has reached Redis and run
            assert await leases(REDIS_URL, redis_prefix, "t") == 0
            whole = await limiter.admit("t", "r2", limits, 1000)
            assert whole.allowed and whole.headers["x-ratelimit-remaining-tokens"] == "0", whole
        finally:
            await limiter.close()

    asyncio.run(through_proxy(body))


@pytest.mark.parametrize("mode", [FailMode.OPEN, FailMode.CLOSED])
def test_admit_cancelled_by_a_client_disconnect_holds_nothing(redis_prefix: str, mode: FailMode) -> None:
    """The request's task is cancelled while the admission's reply is on its way."""
    limits = TenantLimits(tokens_per_minute=1000, max_concurrent=1)

    async def body(proxy: RedisProxy) -> None:
        # A long timeout: the admission waits for its reply until the disconnect cancels it.
        limiter = RedisRateLimiter(proxy.url(), mode, key_prefix=redis_prefix, timeout_s=30)
        try:
            await connected(limiter)
            proxy.hold_replies()
            admitting = asyncio.create_task(limiter.admit("t", "r1", limits, 600))
            await wait_until(lambda: proxy.replies_held >= 1, "Redis answered the admission (its script ran)")
            assert await leases(REDIS_URL, redis_prefix, "t") == 1
            admitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admitting
            proxy.flow()
            await wait_until(no_lease_left(REDIS_URL, redis_prefix), "the cancelled admission's lease went")
            whole = await limiter.admit("t", "r2", limits, 1000)
            assert whole.allowed and whole.headers["x-ratelimit-remaining-tokens"] == "0", whole
        finally:
            await limiter.close()

    asyncio.run(through_proxy(body))


@pytest.mark.parametrize("mode", [FailMode.OPEN, FailMode.CLOSED])
def test_frozen_redis_leaves_no_lease_behind(spare_redis: PrivateRedis, mode: FailMode) -> None:
    """Redis SIGSTOPped while requests end and new ones come and go, then SIGCONTed.

    While it is stopped, every command still lands in its socket buffers and runs after
    SIGCONT, in an order nobody chose: a release may run before the admission it undoes.
    Afterwards no lease may be left and the tenant must get its full capacity back."""
    limits = TenantLimits(tokens_per_minute=10_000, max_concurrent=4)
    prefix = "sluice:rl:"

    async def cycle(limiter: RedisRateLimiter, i: int) -> Admission:
        admission = await limiter.admit("t", f"r{i}", limits, 1000)
        if admission.allowed:
            assert admission.degraded and admission.reservation is not None  # fail-open while frozen
            await limiter.release(admission.reservation, 200)
        return admission

    async def main() -> None:
        limiter = RedisRateLimiter(spare_redis.url, mode, timeout_s=TIMEOUT_S)
        try:
            # Eight open connections, so that each call below goes out at once on its own and
            # waits in Redis' socket buffers (a fresh connection would stall in its handshake).
            warm = TenantLimits(max_concurrent=100)
            pooled = await asyncio.gather(*(limiter.admit("warm-up", f"w{i}", warm, 0) for i in range(8)))
            await asyncio.gather(*(limiter.release(w.reservation, 0) for w in pooled if w.reservation))
            held = [await limiter.admit("t", f"held{i}", limits, 1000) for i in range(2)]
            assert all(h.allowed and not h.degraded and h.reservation is not None for h in held)
            spare_redis.pause()
            try:
                # The held requests end and six more come and go; every call times out.
                ended = [limiter.release(h.reservation, 500) for h in held if h.reservation is not None]
                results = await asyncio.gather(*ended, *(cycle(limiter, i) for i in range(6)))
                admissions = [r for r in results if isinstance(r, Admission)]
                assert all(a.degraded and a.allowed == (mode is FailMode.OPEN) for a in admissions)
            finally:
                spare_redis.resume()
            await wait_until(no_lease_left(spare_redis.url, prefix), "every lease is released")
            # Full capacity: all four slots, and every token but those really used (2 x 500 + 6 x 200).
            whole = await asyncio.gather(*(limiter.admit("t", f"after{i}", limits, 1950) for i in range(4)))
            assert all(a.allowed and not a.degraded for a in whole), whole
        finally:
            await limiter.close()

    asyncio.run(main())
