"""One API request in flight: everything it holds, from its dispatch to its one `finish()`.

A completion request takes up to five things while it runs, and each must be given back
exactly once however the request ends (answered, refused, failed, timed out, client gone):

    what                 taken by                          given back by finish()
    shedder slot         LoadShedder.admit -> Pending      LoadShedder.finished
    tenant ticket        TenantGate.admit -> Ticket        TenantGate.finish (refund + usage record)
                                                           or TenantGate.refuse (refused before a ticket)
    timeline             Observability.start               Observability.finish (metrics, trace)
    in-flight gauge      metrics.in_flight.inc()           metrics.in_flight.dec()
    driver streams       Fanout.open                       Fanout.aclose (aborts in the engine)

and it leaves one log line. `RequestScope` takes them in the order the request meets them and
`finish(outcome)` gives back whatever was taken; it is idempotent, so the first outcome wins and
any later call is a no-op. The service uses the scope as an async context manager (an exception
finishes it with that exception's outcome); a streamed reply takes the scope over (`stream()`)
and finishes it when the stream ends or is closed, even if it never started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import msgspec

from drivers.base import Driver, DriverError, GenerationChunk
from gateway.admission import TenantGate, Ticket
from gateway.fanout import Fanout, LifetimeExceededError
from gateway.load_shedding import LoadShedder, Pending
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.validation import Dispatch, Plan
from observability.hub import TRACE_PARENT, Observability
from observability.timeline import RequestTimeline
from tenants.auth import TenantContext
from tenants.errors import TenantError

log = logging.getLogger("sluice.gateway")


def outcome_of(exc: BaseException) -> str:
    """The status a request that ended with `exc` is recorded with (usage, metrics, log)."""
    if isinstance(exc, asyncio.CancelledError):
        return "disconnected"
    if isinstance(exc, LifetimeExceededError):
        return "timeout"
    if isinstance(exc, DriverError | TenantError):
        return type(exc).__name__
    return "error"


@dataclass(frozen=True)
class Serving:
    """What every request in flight shares; the service builds one per request from its state."""

    driver: Driver
    settings: Settings
    metrics: GatewayMetrics
    shedder: LoadShedder
    gate: TenantGate | None  # None: auth is off, nothing is limited or recorded
    observability: Observability | None  # None: request metrics and traces are off


class RequestScope:
    def __init__(
        self, serving: Serving, request_id: str, caller: TenantContext | None, model: str | None
    ) -> None:
        self.serving = serving
        self.request_id = request_id
        self.caller = caller
        self.dispatch: Dispatch | None = None
        self.ticket: Ticket | None = None
        self.ttft: float | None = None  # seconds to the first chunk of every choice
        self.completion: list[int] = []  # completion tokens of each choice, as last reported
        self._model = model  # what the body asked for, until the plan resolves it
        self._pending: Pending | None = None
        self._timeline: RequestTimeline | None = None
        self._fanout: Fanout | None = None
        self._in_flight = False  # counted in the gauge
        self._opened_at = 0.0  # loop.time() when the driver streams were opened
        self._usage_recorded = False  # the gate recorded a refusal itself
        self._handed_off = False  # a stream owns the scope now
        self._finished = False

    @property
    def headers(self) -> dict[str, str]:
        """x-ratelimit-* headers for the response."""
        return self.ticket.headers if self.ticket is not None else {}

    # -- before the engine: dispatch, shed, admit -----------------------------------------------

    async def prepare(self, plan: Callable[[], Plan]) -> Dispatch:
        """Check the request (`plan`), tokenize each distinct prompt once; the tenant's tier becomes
        the engine priority."""
        checked = plan()
        self._model = checked.card.id
        dispatch = await checked.tokenize(self.serving.driver, self.serving.settings.max_default_tokens)
        caller = self.caller
        if caller is not None:
            # The tenant's tier orders its work in the engine (lower = sooner); see tenants.models. A
            # request's own `priority` may only lower its importance below the tier, never raise it.
            requests = [
                msgspec.structs.replace(r, priority=max(caller.priority, r.priority), tenant_id=caller.tenant_id)
                for r in dispatch.requests
            ]
            dispatch = dataclasses.replace(dispatch, requests=requests)
        self.dispatch = dispatch
        self.completion = [0] * len(dispatch.requests)
        return dispatch

    async def admit(self) -> None:
        """Refuse now (OverloadedError: 503 + Retry-After) what would miss its tier's TTFT target;
        then the tenant's limits (the ticket reserves prompt + max_tokens)."""
        dispatch = self._dispatched()
        serving = self.serving
        first = dispatch.requests[0]
        max_tokens = sum(r.max_tokens or 0 for r in dispatch.requests)
        health = await serving.driver.health()
        try:
            self._pending = serving.shedder.admit(health, first.priority, dispatch.prompt_tokens, max_tokens)
        except DriverError as exc:
            log.info("shed", extra={"request_id": self.request_id, "priority": first.priority, "reason": str(exc)})
            await self.finish("shed")
            raise
        if serving.gate is None or self.caller is None:
            return
        try:
            self.ticket = await serving.gate.admit(
                self.caller, self.request_id, dispatch.model, dispatch.prompt_tokens + max_tokens
            )
        except TenantError:
            self._usage_recorded = True  # the gate wrote the refusal's usage record
            raise

    # -- the engine ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Start the driver streams and wait for the first chunk of every choice; errors so far are
        plain JSON responses."""
        dispatch = self._dispatched()
        serving = self.serving
        loop = asyncio.get_running_loop()
        self._opened_at = loop.time()
        self._fanout = Fanout(
            serving.driver, dispatch.requests, deadline=self._opened_at + serving.settings.stream_timeout_s
        )
        if serving.observability is not None:
            tenant = self.caller.tenant_id if self.ticket is not None and self.caller is not None else None
            operation = "chat" if self.request_id.startswith("chatcmpl") else "text_completion"
            self._timeline = serving.observability.start(
                self.request_id, dispatch.model, operation, dispatch.requests, tenant, TRACE_PARENT.get()
            )
        serving.metrics.in_flight.inc()
        self._in_flight = True
        await self._fanout.open()
        if self._pending is not None:
            serving.shedder.started(self._pending)
        self.ttft = loop.time() - self._opened_at
        serving.metrics.ttft.labels(model=dispatch.model).observe(self.ttft)

    async def chunks(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """Every chunk of every choice, recorded (timeline, completion tokens) before it is yielded."""
        assert self._fanout is not None, "open() first"
        timeline = self._timeline
        async for i, chunk in self._fanout.chunks():
            self.completion[i] = chunk.completion_tokens
            if timeline is not None:
                timeline.add(i, chunk)
            yield i, chunk

    # -- the end -----------------------------------------------------------------------------------

    def stream(self, events: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        """Hand the scope to a streamed reply: it finishes when `events` ends or the reply is closed."""
        self._handed_off = True
        return _ScopedStream(events, self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            await self.finish(outcome_of(exc))
        elif not self._handed_off:
            await self.finish("ok")

    async def finish(self, outcome: str) -> None:
        """Give back everything the request holds; the first call wins, later ones do nothing."""
        if self._finished:
            return
        self._finished = True
        serving = self.serving
        if self._fanout is not None:
            await self._fanout.aclose()  # client gone or done: abort and release everything
        if self._pending is not None:
            serving.shedder.finished(self._pending)
        if self._in_flight:
            serving.metrics.in_flight.dec()
        telemetry = self._end_timeline(outcome)
        dispatch = self.dispatch
        gate, caller = serving.gate, self.caller
        if dispatch is None or self.ttft is None:
            # Never reached the engine's first token. A refusal before the ticket leaves its own record.
            if self.ticket is not None and gate is not None and dispatch is not None:
                await _settle(gate.finish(self.ticket, dispatch.prompt_tokens, 0, None, outcome))
            elif gate is not None and caller is not None and not self._usage_recorded:
                model = dispatch.model if dispatch is not None else self._model or ""
                gate.refuse(caller, self.request_id, model, outcome)
            return
        total = sum(self.completion)
        metrics = serving.metrics
        metrics.prompt_tokens.labels(model=dispatch.model).inc(dispatch.prompt_tokens)
        metrics.completion_tokens.labels(model=dispatch.model).inc(total)
        elapsed = asyncio.get_running_loop().time() - self._opened_at
        metrics.e2e.labels(model=dispatch.model).observe(elapsed)
        log.info(
            "generation finished",
            extra={
                "request_id": self.request_id,
                "model": dispatch.model,
                "n": len(dispatch.requests),
                "prompt_tokens": dispatch.prompt_tokens,
                "completion_tokens": total,
                "outcome": outcome,
                "duration_s": round(elapsed, 4),
                "tenant": caller.tenant_id if self.ticket is not None and caller is not None else None,
                **telemetry,
                # Dropped by the log formatter unless SLUICE_LOG_PROMPTS=1; built only then.
                **({"prompt": [r.prompt or r.messages or r.prompt_token_ids for r in dispatch.requests]}
                   if serving.settings.log_prompts else {}),
            },
        )
        if self.ticket is not None and gate is not None:
            await _settle(gate.finish(self.ticket, dispatch.prompt_tokens, total, self.ttft, outcome))

    def _end_timeline(self, outcome: str) -> dict[str, object]:
        """Metrics and trace of the request; returns fields for its log line (node, trace id)."""
        timeline, self._timeline = self._timeline, None
        observability = self.serving.observability
        if timeline is None or observability is None:
            return {}
        try:
            return observability.finish(timeline, outcome)
        except Exception:
            log.exception("recording telemetry failed", extra={"request_id": self.request_id})
            return {}

    def _dispatched(self) -> Dispatch:
        assert self.dispatch is not None, "prepare() first"
        return self.dispatch


class _ScopedStream:
    """A streamed reply that owns its request's scope: closing it finishes the scope even when the
    generator never ran (a client gone before the first byte), which a bare generator cannot do."""

    def __init__(self, events: AsyncGenerator[bytes, None], scope: RequestScope) -> None:
        self._events = events
        self._scope = scope

    def __aiter__(self) -> _ScopedStream:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._scope.finish("disconnected")


async def _settle(release: asyncio.Task[None] | None) -> None:
    """Wait for a refund so the next request (on any replica) sees it; shielded, because a client
    disconnect cancels us and the refund must complete regardless."""
    if release is not None:
        await asyncio.shield(release)
