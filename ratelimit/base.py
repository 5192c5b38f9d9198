"""The contract of tenant admission control: token buckets and a concurrency cap per tenant.

The gateway calls `admit()` once per request, before dispatch, with the
tokens it reserves (prompt tokens + max_tokens); on the request's end it
calls `release()` with the tokens really used, so unused ones go back to the
bucket and the concurrent-stream slot is freed. Backends (in-process, Redis)
are chosen through `ratelimit.registry` and must give the same answers.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class FailMode(enum.StrEnum):
    """What a shared backend does when it cannot be reached."""

    OPEN = "open"  # admit (and log + count the failure)
    CLOSED = "closed"  # refuse with 503 + Retry-After


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Reservation:
    """What an admitted request holds until `release()`."""

    tenant_id: str
    request_id: str
    tokens: int
    limits: TenantLimits


@dataclass(frozen=True)
class Admission:
    allowed: bool
    # When refused: which limit ("requests", "tokens", "concurrency") and when to retry.
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
    async def admit(self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Admission:
        """Check and charge one request and `tokens` tokens atomically; never raises for backend outages."""

    @abstractmethod
    async def release(self, reservation: Reservation, tokens_used: int) -> None:
        """Refund `reservation.tokens - tokens_used` and free the concurrency slot; never raises."""

    @abstractmethod
    async def close(self) -> None: ...
