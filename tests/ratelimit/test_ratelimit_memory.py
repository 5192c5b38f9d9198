"""What only the in-process backend has: forgetting idle tenants; and how long the gateway's leases last."""

from __future__ import annotations

import asyncio

from ratelimit_support import StepClock

from gateway.settings import Settings
from gateway.tenancy import create_limiter
from ratelimit.base import LEASE_GRACE_S, Reservation, TenantLimits
from ratelimit.memory import InProcessRateLimiter


def test_idle_tenants_are_forgotten_once_full_and_free() -> None:
    async def main() -> None:
        clock = StepClock()
        limiter = InProcessRateLimiter(lease_s=600, clock=clock)
        limits = TenantLimits(requests_per_minute=60, tokens_per_minute=600, max_concurrent=4)
        held = await limiter.admit("busy", "r0", limits, 600)  # tokens full again only after 60 s
        assert held.reservation is not None
        for i in range(1022):
            admission = await limiter.admit(f"t{i}", "r", limits, 1)
            assert admission.reservation is not None
            await limiter.release(admission.reservation, 1)
        assert len(limiter._tenants) == 1023

        await limiter.release(Reservation("gone", "r", 1, limits), 1)  # a tombstone, for one lease
        assert len(limiter._tenants) == 1024

        clock.advance(61)  # every bucket has refilled; "busy" still holds a slot, "gone" a tombstone
        await limiter.admit("late", "r", limits, 1)  # the 1024th admission sweeps first
        assert set(limiter._tenants) == {"busy", "gone", "late"}
        # The forgotten tenants come back with full buckets, as if never seen.
        again = await limiter.admit("t0", "r2", limits, 600)
        assert again.allowed and again.headers["x-ratelimit-remaining-tokens"] == "0"

        clock.advance(600)  # busy's lease and the tombstone have run out
        limiter._sweep(clock())
        assert "busy" not in limiter._tenants and "gone" not in limiter._tenants

    asyncio.run(main())


def test_leases_follow_the_gateway_stream_timeout() -> None:
    """A lease outlives the longest request by a grace, whatever SLUICE_STREAM_TIMEOUT_S says."""
    limiter = create_limiter(Settings(stream_timeout_s=30.0))
    assert isinstance(limiter, InProcessRateLimiter)
    assert limiter.lease_s == 30.0 + LEASE_GRACE_S
