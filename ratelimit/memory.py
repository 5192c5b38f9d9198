"""The in-process rate limiter: per-tenant buckets in a dict, for a single gateway replica.

Same answers as the Redis backend (both follow `ratelimit.buckets`), but the
state lives in this process, so replicas do not share it.

asyncio-safe without a lock: `admit()` and `release()` never await between
reading a tenant's state and writing it back, so no other task can interleave.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ratelimit.base import Admission, RateLimiter, Reservation, TenantLimits
from ratelimit.buckets import TokenBucket, decide
from ratelimit.headers import ratelimit_headers

# How many admissions between sweeps of idle tenants (full buckets, nothing in flight).
_SWEEP_EVERY = 1024


@dataclass
class _TenantState:
    """One tenant's buckets (None level = full) and its in-flight request ids with lease expiries."""

    requests_level: float | None = None
    requests_at: float = 0.0
    tokens_level: float | None = None
    tokens_at: float = 0.0
    in_flight: dict[str, float] = field(default_factory=dict)
    # When both buckets will be full again: after that the state says nothing a fresh one wouldn't.
    idle_at: float = 0.0


class InProcessRateLimiter(RateLimiter):
    """Token buckets (requests, tokens) and a leased concurrency count per tenant, in memory."""

    def __init__(self, lease_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`lease_s`: how long an admitted request holds its concurrency slot if never released."""
        self.lease_s = lease_s
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._admissions = 0

    async def admit(self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Admission:
        tokens = max(0, tokens)
        reservation = Reservation(tenant_id, request_id, tokens, limits)
        if limits == TenantLimits():
            return Admission(True, reservation=reservation)
        now = self._clock()
        self._admissions += 1
        if self._admissions % _SWEEP_EVERY == 0:
            self._sweep(now)
        state = self._tenants.setdefault(tenant_id, _TenantState())
        state.in_flight = {rid: exp for rid, exp in state.in_flight.items() if exp > now}

        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        requests = TokenBucket(rpm or 0)
        token_bucket = TokenBucket(tpm or 0)
        requests_level = requests.level_at(state.requests_level, state.requests_at, now)
        tokens_level = token_bucket.level_at(state.tokens_level, state.tokens_at, now)
        verdict = decide(limits, requests_level, tokens_level, len(state.in_flight), tokens)

        if verdict.allowed:
            if rpm is not None:
                requests_level -= 1
                state.requests_level, state.requests_at = requests_level, now
            if tpm is not None:
                tokens_level -= tokens
                state.tokens_level, state.tokens_at = tokens_level, now
            state.in_flight[request_id] = now + self.lease_s
            state.idle_at = now + max(requests.reset_s(requests_level), token_bucket.reset_s(tokens_level))

        headers = ratelimit_headers(
            limits,
            requests_level,
            requests.reset_s(requests_level),
            tokens_level,
            token_bucket.reset_s(tokens_level),
        )
        if not verdict.allowed:
            return Admission(
                False,
                refused_by=verdict.refused_by,
                retry_after_s=verdict.retry_after_s,
                headers=headers,
                message=verdict.message,
            )
        return Admission(True, reservation=reservation, headers=headers)

    async def release(self, reservation: Reservation, tokens_used: int) -> None:
        state = self._tenants.get(reservation.tenant_id)
        if state is None:
            return
        now = self._clock()
        expiry = state.in_flight.pop(reservation.request_id, None)
        # Released twice, or the lease ran out (the slot was already given back): refund nothing.
        if expiry is None or expiry <= now:
            return
        tpm = reservation.limits.tokens_per_minute
        if tpm is None:
            return
        bucket = TokenBucket(tpm)
        level = bucket.level_at(state.tokens_level, state.tokens_at, now)
        level = bucket.refund(level, reservation.tokens - max(0, tokens_used))
        state.tokens_level, state.tokens_at = level, now

    async def close(self) -> None:
        self._tenants.clear()

    def _sweep(self, now: float) -> None:
        """Forget tenants whose buckets are full again and who hold no live slot."""
        for tenant_id, state in list(self._tenants.items()):
            if now >= state.idle_at and all(exp <= now for exp in state.in_flight.values()):
                del self._tenants[tenant_id]
