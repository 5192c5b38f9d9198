"""The admission semantics, run identically against the in-process and the Redis backend."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

from ratelimit_support import Backend

from ratelimit.base import TenantLimits

RESET = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d{1,3})?s)$")
# Retry-after values are rate math; the tolerance only absorbs the time the test itself takes.
TOL_S = 0.5


def run(backend: Backend, body: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await body()
        finally:
            await backend.close()

    asyncio.run(main())


def test_concurrent_admits_against_requests_bucket_admit_exactly_n(backend: Backend) -> None:
    async def body() -> None:
        replicas = [backend.make(), backend.make()]
        limits = TenantLimits(requests_per_minute=10)
        results = await asyncio.gather(*(replicas[i % 2].admit("t", f"r{i}", limits, 1) for i in range(50)))
        assert sum(a.allowed for a in results) == 10
        refused = [a for a in results if not a.allowed]
        assert {a.refused_by for a in refused} == {"requests"}
        # One request refills in 60/10 = 6 s.
        assert all(6 - TOL_S <= a.retry_after_s <= 6 for a in refused)

    run(backend, body)


def test_token_reservation_refund_lets_another_replica_in(backend: Backend) -> None:
    async def body() -> None:
        a, b = backend.make(), backend.make()
        limits = TenantLimits(tokens_per_minute=1500)
        first = await a.admit("t", "r1", limits, 1000)
        assert first.allowed and first.reservation is not None
        assert first.reservation.tokens == 1000

        second = await b.admit("t", "r2", limits, 1000)
        assert not second.allowed and second.refused_by == "tokens"
        # 500 tokens short at 1500/60 = 25 tokens/s: 20 s.
        assert 20 - TOL_S <= second.retry_after_s <= 20

        await a.release(first.reservation, 100)  # 900 come back: ~1400 in the bucket
        third = await b.admit("t", "r2", limits, 1000)
        assert third.allowed, third
        assert 399 <= int(third.headers["x-ratelimit-remaining-tokens"]) <= 410

    run(backend, body)


def test_refund_never_exceeds_capacity_and_overuse_is_not_charged(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make()
        limits = TenantLimits(tokens_per_minute=60_000)  # 1000 tokens/s
        first = await limiter.admit("t", "r1", limits, 100)
        assert first.reservation is not None
        await asyncio.sleep(0.15)  # refilled already: the refund must not push the bucket above capacity
        await limiter.release(first.reservation, 0)
        full = await limiter.admit("t", "r2", limits, 60_000)
        assert full.allowed, full
        assert full.headers["x-ratelimit-remaining-tokens"] == "0"
        assert full.reservation is not None
        await limiter.release(full.reservation, 10**6)  # used more than reserved: refund 0, no extra debt
        after = await limiter.admit("t", "r3", limits, 100)
        assert not after.allowed and after.refused_by == "tokens"
        assert after.retry_after_s <= 0.1  # 100 tokens at 1000/s, not a million in debt

    run(backend, body)


def test_reservation_above_capacity_is_refused_outright_and_charges_nothing(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make()
        limits = TenantLimits(requests_per_minute=5, tokens_per_minute=1500)
        huge = await limiter.admit("t", "r1", limits, 2000)
        assert not huge.allowed and huge.refused_by == "tokens"
        assert huge.retry_after_s == 0.0
        assert huge.message is not None and "never" in huge.message and "1500" in huge.message
        assert huge.headers["x-ratelimit-remaining-requests"] == "5"
        whole = await limiter.admit("t", "r2", limits, 1500)
        assert whole.allowed

    run(backend, body)


def test_refill_over_time(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make()
        limits = TenantLimits(tokens_per_minute=6000)  # 100 tokens/s
        assert (await limiter.admit("t", "r1", limits, 6000)).allowed
        short = await limiter.admit("t", "r2", limits, 50)
        assert not short.allowed and short.refused_by == "tokens"
        assert 0.5 - TOL_S / 2 <= short.retry_after_s <= 0.5
        await asyncio.sleep(0.2)
        later = await limiter.admit("t", "r2", limits, 50)
        assert not later.allowed and later.retry_after_s <= 0.3 + 0.01  # it went down with time
        await asyncio.sleep(later.retry_after_s + 0.05)
        assert (await limiter.admit("t", "r2", limits, 50)).allowed

    run(backend, body)


def test_retry_after_is_the_longest_wait_among_short_limits(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make()
        limits = TenantLimits(requests_per_minute=1, tokens_per_minute=600)
        assert (await limiter.admit("t", "r1", limits, 600)).allowed
        refused = await limiter.admit("t", "r2", limits, 300)
        # requests: 60 s for one request; tokens: 300 at 10/s = 30 s. Named: the first, waits: the longest.
        assert refused.refused_by == "requests"
        assert 60 - TOL_S <= refused.retry_after_s <= 60

    run(backend, body)


def test_concurrency_cap_and_release(backend: Backend) -> None:
    async def body() -> None:
        a, b = backend.make(), backend.make()
        limits = TenantLimits(max_concurrent=2)
        one = await a.admit("t", "r1", limits, 10)
        two = await b.admit("t", "r2", limits, 10)
        assert one.allowed and two.allowed and one.reservation is not None
        three = await a.admit("t", "r3", limits, 10)
        assert not three.allowed and three.refused_by == "concurrency"
        assert three.retry_after_s == 1.0
        other_tenant = await a.admit("u", "r3", limits, 10)
        assert other_tenant.allowed
        await b.release(one.reservation, 10)
        assert (await a.admit("t", "r3", limits, 10)).allowed
        assert not (await b.admit("t", "r4", limits, 10)).allowed

    run(backend, body)


def test_expired_lease_is_purged_and_its_late_release_frees_nothing(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make(lease_s=0.3)
        limits = TenantLimits(tokens_per_minute=1000, max_concurrent=1)
        held = await limiter.admit("t", "r1", limits, 500)
        assert held.allowed and held.reservation is not None
        assert (await limiter.admit("t", "r2", limits, 1)).refused_by == "concurrency"
        await asyncio.sleep(0.4)  # r1's replica "died": its lease runs out
        fresh = await limiter.admit("t", "r2", limits, 400)
        assert fresh.allowed, fresh
        # r1's late release must neither free r2's slot nor refund r1's tokens.
        await limiter.release(held.reservation, 0)
        assert (await limiter.admit("t", "r3", limits, 1)).refused_by == "concurrency"
        assert fresh.reservation is not None
        await limiter.release(fresh.reservation, 400)
        refused = await limiter.admit("t", "r4", limits, 500)
        assert not refused.allowed and refused.refused_by == "tokens"

    run(backend, body)


def test_double_release_refunds_once(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make()
        limits = TenantLimits(tokens_per_minute=1000)
        a = await limiter.admit("t", "a", limits, 600)
        b = await limiter.admit("t", "b", limits, 300)
        assert a.reservation is not None and b.allowed
        await limiter.release(a.reservation, 0)  # ~700 left
        await limiter.release(a.reservation, 0)  # a no-op, not another 600
        refused = await limiter.admit("t", "c", limits, 800)
        assert not refused.allowed and refused.refused_by == "tokens"

    run(backend, body)


def test_headers_on_allow_and_refuse(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make()
        limits = TenantLimits(requests_per_minute=2, tokens_per_minute=120, max_concurrent=5)
        names = {
            f"x-ratelimit-{what}-{kind}"
            for what in ("limit", "remaining", "reset")
            for kind in ("requests", "tokens")
        }
        allowed = await limiter.admit("t", "r1", limits, 60)
        assert allowed.allowed and set(allowed.headers) == names
        assert allowed.headers["x-ratelimit-limit-requests"] == "2"
        assert allowed.headers["x-ratelimit-remaining-requests"] == "1"
        assert allowed.headers["x-ratelimit-limit-tokens"] == "120"
        assert allowed.headers["x-ratelimit-remaining-tokens"] == "60"
        assert allowed.headers["x-ratelimit-reset-requests"] in {"30s", "29.999s", "29.998s"}
        for name in names:
            if "reset" in name:
                assert RESET.match(allowed.headers[name]), allowed.headers
        assert (await limiter.admit("t", "r2", limits, 60)).allowed
        refused = await limiter.admit("t", "r3", limits, 1)
        assert not refused.allowed and set(refused.headers) == names
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        assert re.match(r"^5\d\.\d+s$|^1m0s$", refused.headers["x-ratelimit-reset-requests"]), refused.headers
        # An unlimited kind sends no headers; no limits at all, none.
        only_tokens = await limiter.admit("u", "r1", TenantLimits(tokens_per_minute=10), 1)
        assert set(only_tokens.headers) == {n for n in names if n.endswith("-tokens")}
        free = await limiter.admit("v", "r1", TenantLimits(), 10**9)
        assert free.allowed and free.headers == {} and free.reservation is not None
        await limiter.release(free.reservation, 10)

    run(backend, body)
