"""The contract of tenant admission control: token buckets and a concurrency cap per tenant.

The gateway calls `admit()` once per request, before dispatch, with a request
id it chose, the tokens it reserves (prompt tokens + max_tokens) and the
sequences it will run (prompts x n). Every admit ends in exactly one
`release()` by that id, with the tokens really used (0 when the request never
ran: a full refund), so unused tokens go back to the bucket and the sequences'
concurrency slots are freed. Backends (in-process, Redis) are chosen through
`ratelimit.registry` and must give the same answers.

Exactly once, whatever happens, by request id:

    admit(id) ──────────────▶ release(id)          the usual order
    release(id) ─▶ admit(id)                       the admit's reply was lost and the admit
                                                   reached the backend late: it charges nothing
    release(id) ─▶ release(id)                     the second changes nothing
    admit(id) ─▶ admit(id)                         the second charges nothing

A release the backend cannot take now (an outage) is retried by the backend
until it lands or the lease has run out; a lease is the backstop for a
replica that dies holding slots (see `lease_for`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

# How long a lease outlives the longest request: time for the request's release to land after its
# last byte (a slow client, a release retried through a short Redis outage, a drain on shutdown).
LEASE_GRACE_S = 60.0
def lease_for(request_lifetime_s: float) -> float:
    """The lease for requests that run at most `request_lifetime_s` (the gateway's stream timeout).

    A lease only matters when its release never comes (the replica died, or Redis
    was away for longer than the lease): then the slot is held until the lease ends.
    Shorter than a request's life would free live requests' slots; much longer keeps
    a dead replica's slots from the tenant for no reason.
    """
    return request_lifetime_s + LEASE_GRACE_S


# The lease of a limiter built without one: for the gateway's default stream timeout of 600 s.
DEFAULT_LEASE_S = lease_for(600.0)


class FailMode(enum.StrEnum):
    """What a shared backend does when it cannot be reached."""

    OPEN = "open"  # admit (and log + count the failure)
    CLOSED = "closed"  # refuse with 503 + Retry-After


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; None means unlimited. `max_concurrent` bounds concurrent sequences
    (a request with 4 prompts and n=2 runs 8), not requests."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Reservation:
    """What an admitted request holds until `release()`; the caller may rebuild it to release by id."""

    tenant_id: str
    request_id: str
    tokens: int
    limits: TenantLimits
    sequences: int = 1


@dataclass(frozen=True)
class Admission:
    allowed: bool
    # When refused: which limit ("requests", "tokens", "concurrency"), "unavailable" (backend
    # away, fail-closed) or "released" (this id was released already), and when to retry.
    refused_by: str | None = None
    retry_after_s: float = 0.0
    reservation: Reservation | None = None
    # OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers, ready to send.
    headers: dict[str, str] = field(default_factory=dict)
    # True when the backend was unreachable and FailMode decided.
    degraded: bool = False
    # Human-readable reason for a refusal, for the error body. A refusal with
    # retry_after_s == 0 can never pass as sent (e.g. it reserves more tokens
    # than the tokens-per-minute limit): retrying will not help.
    message: str | None = None


class RateLimiter(ABC):
    @abstractmethod
    async def admit(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int, sequences: int = 1
    ) -> Admission:
        """Check and charge one request, `tokens` tokens and `sequences` concurrency slots atomically.

        Never raises for backend outages. If the caller is cancelled, or the backend's
        answer is lost, while the charge may have happened, the backend gives it back itself.
        """

    @abstractmethod
    async def release(self, reservation: Reservation, tokens_used: int) -> None:
        """Refund `reservation.tokens - tokens_used` and free its slots; never raises.

        Idempotent by `reservation.request_id`; a release before its admit makes that admit
        charge nothing. When the backend is away, the release is retried in the background.
        """

    @abstractmethod
    async def close(self) -> None: ...
