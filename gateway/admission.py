"""Per-request tenant admission: budget and rate limits before dispatch, release and usage after.

    count(caller, ...)       monthly budget, then the request against requests_per_minute: before its
                             prompt is tokenized, so a request refused later still counts
    admit(..., tokens, sequences) -> Ticket   monthly budget, then RateLimiter.admit(prompt + max_tokens,
                                              prompts x n sequences against max_concurrent)
    finish(ticket, ...)      the request ran: RateLimiter.release(actual tokens) + one usage record
    cancel(ticket, status)   it was refused or failed before it ran: every reserved token back,
                             a usage record of 0 tokens
    refuse(caller, ...)      a usage record of 0 tokens for a request that was never admitted

A ticket ends in exactly one `finish` or `cancel` (the later calls do nothing), so
its slots are freed and its tokens refunded once. Both run the release as its own
task so a client disconnect (which cancels the request's task) can never cancel a
refund half-way; callers may await it. A disconnect during `admit` is the
limiter's to undo (`RateLimiter.admit`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace

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

    async def count(self, caller: TenantContext, request_id: str, model: str) -> dict[str, str]:
        """Count the request against requests_per_minute (after the monthly budget), before the
        expensive work, or raise QuotaExceeded / RateLimited / LimiterUnavailable; returns its
        x-ratelimit-*-requests headers. `admit(..., counted=True)` then skips the request limit.

        TODO(ratelimit): a counting-only RateLimiter call would save a round trip. Until then, an
        admission of its own id (`<request id>/count`) under the request limit alone, released at
        once: its lease holds no slot any longer than that, and no token."""
        await self._check_budget(caller, request_id, model)
        rpm = caller.limits.requests_per_minute
        if rpm is None:
            return {}
        admission = await self.limiter.admit(
            caller.tenant_id, f"{request_id}/count", TenantLimits(requests_per_minute=rpm), 0
        )
        if not admission.allowed:
            self.refuse(caller, request_id, model, "rate_limited")
            raise _refusal(admission)
        if admission.reservation is not None:
            self._track(asyncio.create_task(self.limiter.release(admission.reservation, 0)))
        return dict(admission.headers)

    async def admit(
        self,
        caller: TenantContext,
        request_id: str,
        model: str,
        tokens: int,
        sequences: int = 1,
        counted: bool = False,
    ) -> Ticket:
        """Charge `tokens` (prompt + max_tokens) and `sequences` (prompts x n) concurrency slots,
        and the request itself unless `count()` did (`counted`), or raise QuotaExceeded /
        RateLimited / LimiterUnavailable."""
        await self._check_budget(caller, request_id, model)
        limits = replace(caller.limits, requests_per_minute=None) if counted else caller.limits
        admission = await self.limiter.admit(caller.tenant_id, request_id, limits, tokens, sequences)
        if not admission.allowed:
            self.refuse(caller, request_id, model, "rate_limited")
            raise _refusal(admission)
        return Ticket(caller, request_id, model, admission.reservation, dict(admission.headers))

    async def _check_budget(self, caller: TenantContext, request_id: str, model: str) -> None:
        budget = caller.monthly_token_budget
        if budget is not None and await self.monthly.used(caller.tenant_id) >= budget:
            self.refuse(caller, request_id, model, "insufficient_quota")
            raise QuotaExceededError(
                f"Tenant '{caller.tenant_name}' has used its monthly budget of {budget} tokens"
            )

    def finish(
        self,
        ticket: Ticket,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        status: str,
    ) -> asyncio.Task[None] | None:
        """The request ran: refund what it did not use, free its slots and record its usage.

        Returns the task that completes the release (None when there is nothing to release)."""
        if ticket.finished:
            return None
        ticket.finished = True
        total = prompt_tokens + completion_tokens
        self.monthly.add(ticket.caller.tenant_id, total)
        self._record(ticket, prompt_tokens, completion_tokens, ttft_s, status)
        return self._release(ticket, total)

    def cancel(self, ticket: Ticket, status: str) -> asyncio.Task[None] | None:
        """The admitted request was refused or failed before it ran (queue full, engine dead, a 4xx):
        give back every token it reserved, free its slots, record usage of 0 tokens.

        Exactly once with `finish`: whichever comes first counts. Returns the release's task."""
        if ticket.finished:
            return None
        ticket.finished = True
        self._record(ticket, 0, 0, None, status)
        return self._release(ticket, 0)

    def _record(
        self, ticket: Ticket, prompt_tokens: int, completion_tokens: int, ttft_s: float | None, status: str
    ) -> None:
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

    def _release(self, ticket: Ticket, tokens_used: int) -> asyncio.Task[None] | None:
        if ticket.reservation is None:
            return None
        return self._track(asyncio.create_task(self.limiter.release(ticket.reservation, tokens_used)))

    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    def refuse(self, caller: TenantContext, request_id: str, model: str, status: str) -> None:
        """A request refused before it was admitted (bad input, shed, budget, limits): usage of 0 tokens,
        nothing to release."""
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
