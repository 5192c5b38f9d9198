"""Per-request tenant admission: budget and rate limits before dispatch, release and usage after.

    admit()  -> Ticket       monthly budget, then RateLimiter.admit: counts the request (and its
                             concurrency slot) before its prompt is tokenized
    reserve(ticket, tokens)  takes prompt + max_tokens from the tokens-per-minute bucket
    finish(ticket, ...)      RateLimiter.release(actual tokens) + one usage record; exactly once
    refuse(caller, ...)      a usage record for a request that never reached the engine

`finish` runs the release as its own task so a client disconnect (which cancels
the request's task) can never cancel a refund half-way; callers may await it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from ratelimit.base import Admission, RateLimiter, Reservation, TenantLimits
from tenants.auth import TenantContext
from tenants.errors import LimiterUnavailableError, QuotaExceededError, RateLimitedError
from tenants.usage import MonthlyUsage, UsageEvent, UsageWriter

log = logging.getLogger("sluice.gateway")


@dataclass
class Ticket:
    """What an admitted request carries to its end."""

    caller: TenantContext
    request_id: str
    model: str
    reservation: Reservation | None
    headers: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    finished: bool = False


class TenantGate:
    def __init__(self, limiter: RateLimiter, usage: UsageWriter, monthly: MonthlyUsage) -> None:
        self.limiter = limiter
        self.usage = usage
        self.monthly = monthly
        self._releases: set[asyncio.Task[None]] = set()

    async def admit(self, caller: TenantContext, request_id: str, model: str, tokens: int) -> Ticket:
        """Charge `tokens` (prompt + max_tokens) or raise QuotaExceeded / RateLimited / LimiterUnavailable."""
        budget = caller.monthly_token_budget
        if budget is not None and await self.monthly.used(caller.tenant_id) >= budget:
            self.refuse(caller, request_id, model, "insufficient_quota")
            raise QuotaExceededError(
                f"Tenant '{caller.tenant_name}' has used its monthly budget of {budget} tokens"
            )
        admission = await self.limiter.admit(caller.tenant_id, request_id, caller.limits, tokens)
        if not admission.allowed:
            self.refuse(caller, request_id, model, "rate_limited")
            raise _refusal(admission)
        return Ticket(caller, request_id, model, admission.reservation, dict(admission.headers))

    async def reserve(self, ticket: Ticket, tokens: int) -> None:
        """Take `tokens` (prompt + max_tokens) from the tokens-per-minute bucket of a request that
        admit() counted, or raise RateLimited / LimiterUnavailable; finish() refunds what goes unused.

        TODO(ratelimit): a `RateLimiter.reserve(reservation, tokens)` would do this in one step. Until
        then, a second admission of the same request id under the tokens limit alone: it counts no
        request and takes no second concurrency slot (both backends key requests in flight by id),
        and its reservation, released by finish(), frees the slot the first one took.
        """
        tpm = ticket.caller.limits.tokens_per_minute
        if tpm is None:
            return
        admission = await self.limiter.admit(
            ticket.caller.tenant_id, ticket.request_id, TenantLimits(tokens_per_minute=tpm), tokens
        )
        if not admission.allowed:
            raise _refusal(admission)
        ticket.reservation = admission.reservation
        ticket.headers.update(admission.headers)

    def finish(
        self,
        ticket: Ticket,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        status: str,
    ) -> asyncio.Task[None] | None:
        """Release the reservation and record usage; the returned task completes the release."""
        if ticket.finished:
            return None
        ticket.finished = True
        total = prompt_tokens + completion_tokens
        self.monthly.add(ticket.caller.tenant_id, total)
        self.usage.record(
            UsageEvent(
                request_id=ticket.request_id,
                tenant_id=ticket.caller.tenant_id,
                key_id=ticket.caller.key_id,
                model=ticket.model,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                ttft_ms=None if ttft_s is None else ttft_s * 1000.0,
                latency_ms=(time.monotonic() - ticket.started) * 1000.0,
                status=status,
            )
        )
        if ticket.reservation is None:
            return None
        task = asyncio.create_task(self.limiter.release(ticket.reservation, total))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    def refuse(self, caller: TenantContext, request_id: str, model: str, status: str) -> None:
        self.usage.record(
            UsageEvent(request_id, caller.tenant_id, caller.key_id, model, 0, 0, None, 0.0, status)
        )

    async def close(self) -> None:
        """Wait for refunds still in flight (shutdown)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)


def _refusal(admission: Admission) -> RateLimitedError | LimiterUnavailableError:
    reason = getattr(admission, "message", None) or f"Rate limit reached for {admission.refused_by}"
    if admission.degraded:
        return LimiterUnavailableError(reason, max(1.0, admission.retry_after_s))
    headers = dict(admission.headers)
    if admission.retry_after_s > 0:
        headers["retry-after"] = str(max(1, math.ceil(admission.retry_after_s)))
    return RateLimitedError(reason, admission.retry_after_s, headers)
