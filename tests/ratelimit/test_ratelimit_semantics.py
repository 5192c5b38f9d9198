"""The admission semantics, run identically against the in-process and the Redis backend.

Both run on a `StepClock` the test moves by hand, so refills, waits and lease expiries
are exact rate math, with no sleeping and no tolerance for how long the test takes.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import pytest
from ratelimit_support import Backend, StepClock

from ratelimit.base import Reservation, TenantLimits

RESET = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d{1,3})?s)$")
# Redis answers in whole milliseconds.
MS = 0.001


def run(backend: Backend, body: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await body()
        finally:
            await backend.close()

    asyncio.run(main())


def test_concurrent_admits_against_requests_bucket_admit_exactly_n(backend: Backend) -> None:
    async def body() -> None:
        clock = StepClock()
        replicas = [backend.make(clock=clock), backend.make(clock=clock)]
        limits = TenantLimits(requests_per_minute=10)
        results = await asyncio.gather(*(replicas[i % 2].admit("t", f"r{i}", limits, 1) for i in range(50)))
        assert sum(a.allowed for a in results) == 10
        refused = [a for a in results if not a.allowed]
        assert {a.refused_by for a in refused} == {"requests"}
        # One request refills in 60/10 = 6 s.
        assert all(a.retry_after_s == pytest.approx(6, abs=MS) for a in refused)

    run(backend, body)


def test_token_reservation_refund_lets_another_replica_in(backend: Backend) -> None:
    async def body() -> None:
        clock = StepClock()
        a, b = backend.make(clock=clock), backend.make(clock=clock)
        limits = TenantLimits(tokens_per_minute=1500)
        first = await a.admit("t", "r1", limits, 1000)
        assert first.allowed and first.reservation is not None
        assert first.reservation.tokens == 1000

        second = await b.admit("t", "r2", limits, 1000)
        assert not second.allowed and second.refused_by == "tokens"
        # 500 tokens short at 1500/60 = 25 tokens/s: 20 s.
        assert second.retry_after_s == pytest.approx(20, abs=MS)

        await a.release(first.reservation, 100)  # 900 come back: 1400 in the bucket
        third = await b.admit("t", "r2", limits, 1000)
        assert third.allowed, third
        assert third.headers["x-ratelimit-remaining-tokens"] == "400"

    run(backend, body)


def test_refund_never_exceeds_capacity_and_overuse_is_not_charged(backend: Backend) -> None:
    async def body() -> None:
        clock = StepClock()
        limiter = backend.make(clock=clock)
        limits = TenantLimits(tokens_per_minute=60_000)  # 1000 tokens/s
        first = await limiter.admit("t", "r1", limits, 100)
        assert first.reservation is not None
        clock.advance(0.15)  # refilled already: the refund must not push the bucket above capacity
        await limiter.release(first.reservation, 0)
        full = await limiter.admit("t", "r2", limits, 60_000)
        assert full.allowed, full
        assert full.headers["x-ratelimit-remaining-tokens"] == "0"
        assert full.reservation is not None
        await limiter.release(full.reservation, 10**6)  # used more than reserved: refund 0, no extra debt
        after = await limiter.admit("t", "r3", limits, 100)
        assert not after.allowed and after.refused_by == "tokens"
        assert after.retry_after_s == pytest.approx(0.1, abs=MS)  # 100 tokens at 1000/s, no debt

    run(backend, body)


def test_reservation_above_capacity_is_refused_outright_and_charges_nothing(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make(clock=StepClock())
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
        clock = StepClock()
        limiter = backend.make(clock=clock)
        limits = TenantLimits(tokens_per_minute=6000)  # 100 tokens/s
        assert (await limiter.admit("t", "r1", limits, 6000)).allowed
        short = await limiter.admit("t", "r2", limits, 50)
        assert not short.allowed and short.refused_by == "tokens"
        assert short.retry_after_s == pytest.approx(0.5, abs=MS)
        clock.advance(0.2)
        later = await limiter.admit("t", "r2", limits, 50)
        assert not later.allowed and later.retry_after_s == pytest.approx(0.3, abs=MS)
        clock.advance(0.3)
        assert (await limiter.admit("t", "r2", limits, 50)).allowed

    run(backend, body)


def test_retry_after_is_the_longest_wait_among_short_limits(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make(clock=StepClock())
        limits = TenantLimits(requests_per_minute=1, tokens_per_minute=600)
        assert (await limiter.admit("t", "r1", limits, 600)).allowed
        refused = await limiter.admit("t", "r2", limits, 300)
        # requests: 60 s for one request; tokens: 300 at 10/s = 30 s. Named: the first, waits: the longest.
        assert refused.refused_by == "requests"
        assert refused.retry_after_s == pytest.approx(60, abs=MS)

    run(backend, body)


def test_concurrency_cap_and_release(backend: Backend) -> None:
    async def body() -> None:
        clock = StepClock()
        a, b = backend.make(clock=clock), backend.make(clock=clock)
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


def test_concurrency_counts_sequences_not_requests(backend: Backend) -> None:
    async def body() -> None:
        clock = StepClock()
        a, b = backend.make(clock=clock), backend.make(clock=clock)
        limits = TenantLimits(max_concurrent=8)
        wide = await a.admit("t", "wide", limits, 10, sequences=6)  # e.g. 3 prompts x n=2
        assert wide.allowed and wide.reservation is not None and wide.reservation.sequences == 6
        too_wide = await b.admit("t", "r2", limits, 10, sequences=3)
        assert not too_wide.allowed and too_wide.refused_by == "concurrency"
        assert too_wide.retry_after_s == 1.0
        pair = await b.admit("t", "pair", limits, 10, sequences=2)
        assert pair.allowed  # 6 + 2 = 8
        assert (await a.admit("t", "one", limits, 10)).refused_by == "concurrency"
        await b.release(wide.reservation, 10)  # frees all six
        assert (await a.admit("t", "r5", limits, 10, sequences=6)).allowed
        # More sequences than the cap can never pass: no point retrying.
        never = await a.admit("u", "huge", limits, 10, sequences=64 * 8)
        assert not never.allowed and never.refused_by == "concurrency" and never.retry_after_s == 0
        assert never.message is not None and "512 sequences" in never.message and "8" in never.message
        # A request with no limits, or no sequence count, counts 1.
        assert (await a.admit("v", "r", TenantLimits(max_concurrent=1), 10, sequences=0)).allowed

    run(backend, body)


def test_expired_lease_is_purged_and_its_late_release_frees_nothing(backend: Backend) -> None:
    async def body() -> None:
        clock = StepClock()
        limiter = backend.make(lease_s=0.3, clock=clock)
        limits = TenantLimits(tokens_per_minute=1000, max_concurrent=1)
        held = await limiter.admit("t", "r1", limits, 500)
        assert held.allowed and held.reservation is not None
        assert (await limiter.admit("t", "r2", limits, 1)).refused_by == "concurrency"
        clock.advance(0.4)  # r1's replica "died": its lease runs out
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
        limiter = backend.make(clock=StepClock())
        limits = TenantLimits(tokens_per_minute=1000, max_concurrent=2)
        a = await limiter.admit("t", "a", limits, 600)
        b = await limiter.admit("t", "b", limits, 300)
        assert a.reservation is not None and b.allowed
        await limiter.release(a.reservation, 0)  # 700 left
        await limiter.release(a.reservation, 0)  # a no-op, not another 600, nor another slot
        refused = await limiter.admit("t", "c", limits, 800)
        assert not refused.allowed and refused.refused_by == "tokens"
        assert (await limiter.admit("t", "d", limits, 700)).allowed
        assert (await limiter.admit("t", "e", limits, 0)).refused_by == "concurrency"

    run(backend, body)


def test_full_refund_gives_back_every_token_and_the_slots(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make(clock=StepClock())
        limits = TenantLimits(tokens_per_minute=1000, max_concurrent=4)
        ran_not = await limiter.admit("t", "r1", limits, 1000, sequences=4)
        assert ran_not.reservation is not None
        assert not (await limiter.admit("t", "r2", limits, 1)).allowed
        await limiter.release(ran_not.reservation, 0)  # refused before it ran: nothing used
        again = await limiter.admit("t", "r2", limits, 1000, sequences=4)
        assert again.allowed and again.headers["x-ratelimit-remaining-tokens"] == "0"

    run(backend, body)


def test_release_before_its_admit_makes_that_admit_charge_nothing(backend: Backend) -> None:
    """The rollback of an admit whose reply was lost may reach the backend before the admit does."""

    async def body() -> None:
        limiter = backend.make(clock=StepClock())
        limits = TenantLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=1)
        await limiter.release(Reservation("t", "r1", 1000, limits), 0)
        late = await limiter.admit("t", "r1", limits, 1000)
        assert not late.allowed and late.refused_by == "released"
        assert late.headers["x-ratelimit-remaining-tokens"] == "1000"
        whole = await limiter.admit("t", "r2", limits, 1000)  # the slot and every token are free
        assert whole.allowed and whole.headers["x-ratelimit-remaining-requests"] == "9"

    run(backend, body)


def test_admitting_the_same_id_twice_charges_once(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make(clock=StepClock())
        limits = TenantLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2)
        first = await limiter.admit("t", "r1", limits, 400)
        again = await limiter.admit("t", "r1", limits, 400)
        assert first.allowed and again.allowed and again.reservation is not None
        assert again.headers["x-ratelimit-remaining-tokens"] == "600"
        assert again.headers["x-ratelimit-remaining-requests"] == "9"
        await limiter.release(again.reservation, 0)
        assert (await limiter.admit("t", "r2", limits, 1000, sequences=2)).allowed

    run(backend, body)


def test_headers_on_allow_and_refuse(backend: Backend) -> None:
    async def body() -> None:
        limiter = backend.make(clock=StepClock())
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
        assert allowed.headers["x-ratelimit-reset-requests"] == "30s"
        for name in names:
            if "reset" in name:
                assert RESET.match(allowed.headers[name]), allowed.headers
        assert (await limiter.admit("t", "r2", limits, 60)).allowed
        refused = await limiter.admit("t", "r3", limits, 1)
        assert not refused.allowed and set(refused.headers) == names
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
        # An unlimited kind sends no headers; no limits at all, none.
        only_tokens = await limiter.admit("u", "r1", TenantLimits(tokens_per_minute=10), 1)
        assert set(only_tokens.headers) == {n for n in names if n.endswith("-tokens")}
        free = await limiter.admit("v", "r1", TenantLimits(), 10**9)
        assert free.allowed and free.headers == {} and free.reservation is not None
        await limiter.release(free.reservation, 10)

    run(backend, body)
