"""The in-process rate limiter: per-tenant buckets in a dict, for a single gateway replica.

Same answers as the Redis backend (both follow `ratelimit.buckets`, and the
lease and tombstone rules drawn in `ratelimit.lua`), but the state lives in
this process, so replicas do not share it.

asyncio-safe without a lock: `admit()` and `release()` never await between
reading a tenant's state and writing it back, so no other task can interleave
(and a cancelled caller can never leave a charge half-made).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ratelimit.base import DEFAULT_LEASE_S, Admission, RateLimiter, Reservation, TenantLimits
from ratelimit.buckets import TokenBucket, decide
from ratelimit.headers import ratelimit_headers

# How many admissions between sweeps of idle tenants (full buckets, nothing in flight).
_SWEEP_EVERY = 1024


@dataclass(frozen=True)
class _Lease:
    expires_at: float
    sequences: int


@dataclass
class _TenantState:
    """One tenant's buckets (None level = full), its live leases and its tombstones, by request id."""

    requests_level: float | None = None
    requests_at: float = 0.0
    tokens_level: float | None = None
    tokens_at: float = 0.0
    in_flight: dict[str, _Lease] = field(default_factory=dict)
    # Ids released before they were admitted (or twice), until when: their admission charges nothing.
    released: dict[str, float] = field(default_factory=dict)
    # When both buckets will be full again: after that the state says nothing a fresh one wouldn't.
    idle_at: float = 0.0

    def purge(self, now: float) -> None:
        self.in_flight = {rid: lease for rid, lease in self.in_flight.items() if lease.expires_at > now}
        self.released = {rid: until for rid, until in self.released.items() if until > now}

    def sequences_in_flight(self) -> int:
        return sum(lease.sequences for lease in self.in_flight.values())


class InProcessRateLimiter(RateLimiter):
    """Token buckets (requests, tokens) and leased concurrency slots (sequences) per tenant, in memory."""

    def __init__(
        self, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`lease_s`: how long an admitted request holds its slots if never released (see `lease_for`)."""
        self.lease_s = lease_s
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._admissions = 0

    async def admit(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int, sequences: int = 1
    ) -> Admission:
        tokens, sequences = max(0, tokens), max(1, sequences)
        reservation = Reservation(tenant_id, request_id, tokens, limits, sequences)
        if limits == TenantLimits():
            return Admission(True, reservation=reservation)
        now = self._clock()
        self._admissions += 1
        if self._admissions % _SWEEP_EVERY == 0:
            self._sweep(now)
        state = self._tenants.setdefault(tenant_id, _TenantState())
        state.purge(now)

        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        requests = TokenBucket(rpm or 0)
        token_bucket = TokenBucket(tpm or 0)
        requests_level = requests.level_at(state.requests_level, state.requests_at, now)
        tokens_level = token_bucket.level_at(state.tokens_level, state.tokens_at, now)

        def headers() -> dict[str, str]:  # from the levels as they are when it is called
            return ratelimit_headers(
                limits,
                requests_level,
                requests.reset_s(requests_level),
                tokens_level,
                token_bucket.reset_s(tokens_level),
            )

        if request_id in state.released:
            return Admission(
                False,
                refused_by="released",
                headers=headers(),
                message=f"request {request_id} was released before it was admitted: nothing is charged",
            )
        if request_id in state.in_flight:  # admitted already: charged once
            return Admission(True, reservation=reservation, headers=headers())

        verdict = decide(
            limits, requests_level, tokens_level, state.sequences_in_flight(), tokens, sequences
        )
        if not verdict.allowed:
            return Admission(
                False,
                refused_by=verdict.refused_by,
                retry_after_s=verdict.retry_after_s,
                headers=headers(),
                message=verdict.message,
            )
        if rpm is not None:
            requests_level -= 1
            state.requests_level, state.requests_at = requests_level, now
        if tpm is not None:
            tokens_level -= tokens
            state.tokens_level, state.tokens_at = tokens_level, now
        state.in_flight[request_id] = _Lease(now + self.lease_s, sequences)
        state.idle_at = now + max(requests.reset_s(requests_level), token_bucket.reset_s(tokens_level))
        return Admission(True, reservation=reservation, headers=headers())

    async def release(self, reservation: Reservation, tokens_used: int) -> None:
        if reservation.limits == TenantLimits():
            return
        now = self._clock()
        state = self._tenants.setdefault(reservation.tenant_id, _TenantState())
        lease = state.in_flight.pop(reservation.request_id, None)
        if lease is None:
            # Not admitted (yet), or released already: its admission, if it ever comes, charges nothing.
            state.released[reservation.request_id] = now + self.lease_s
            return
        # The lease ran out (the slot was already given back): refund nothing.
        if lease.expires_at <= now:
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
        """Forget tenants whose buckets are full again and who hold no live lease nor tombstone."""
        for tenant_id, state in list(self._tenants.items()):
            if now >= state.idle_at and not any(
                lease.expires_at > now for lease in state.in_flight.values()
            ) and all(until <= now for until in state.released.values()):
                del self._tenants[tenant_id]
