"""What only the in-process backend has: forgetting idle tenants."""

from __future__ import annotations

import asyncio

from ratelimit.base import TenantLimits
from ratelimit.memory import InProcessRateLimiter


class StepClock:
    """A clock the test moves by hand, so a minute of refill takes no time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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

        clock.now += 61  # every bucket has refilled; "busy" still holds a slot
        await limiter.admit("late", "r", limits, 1)  # the 1024th admission sweeps first
        assert set(limiter._tenants) == {"busy", "late"}
        # The forgotten tenants come back with full buckets, as if never seen.
        again = await limiter.admit("t0", "r2", limits, 600)
        assert again.allowed and again.headers["x-ratelimit-remaining-tokens"] == "0"

    asyncio.run(main())
