"""One API request in flight: everything it holds, from its arrival to its one `finish()`.

A completion request takes up to six things while it runs, and each must be given back
exactly once however the request ends (answered, refused, failed, timed out, client gone):

    what                 taken by                          given back by finish()
    tenant ticket        TenantGate.admit -> Ticket        TenantGate.finish (it ran: refund the rest)
                                                           or .cancel (it did not: refund it all),
                                                           each with the usage record; exactly once
    shedder slot         LoadShedder.admit -> Pending      LoadShedder.finished
    timeline             Observability.start               Observability.finish (metrics, trace)
    in-flight gauge      metrics.in_flight.inc()           metrics.in_flight.dec()
    driver streams       Fanout.open                       Fanout.aclose (aborts in the engine)
    model version lease  ModelRouter.resolve (pin)         ModelRouter.release (versions/routing.py)

and it leaves one log line. The way of a request, and what each step can refuse:

    arrival (stamped before the body is read or the key checked; every duration starts here)
    admit     count the request against the tenant's budget and    429 (budget, requests per minute)
              request limit, before anything expensive
    pin       the model name to one version, by the alias           404
              generation of this moment (versions/routing.py)
    prepare   cheap checks, then each distinct prompt tokenized    400 / 404 / 503 (model loading)
              once, off the event loop
    reserve   shed what would miss its TTFT target, then the       503 (shed) / 429 (tokens,
              tenant's ticket: prompt + max_tokens from its token  concurrency)
              bucket, one concurrency slot per sequence
    open      the driver streams, up to the first chunk of each    503 (queue full, engine dead) / 400
    chunks    ...
    finish(outcome)

`finish` charges the tenant what the engine computed and nothing else (docs/billing.md): the prompt
of every prompt whose prefill produced a token, and the completion tokens the engine reported. A
request refused or failed before its first token is charged nothing, and its reservation goes back.
It is idempotent: the first outcome wins and any later call does nothing. The service uses the
scope as an async context manager (an exception finishes it with that exception's outcome); a
streamed reply takes the scope over (`stream()`) and finishes it when the stream ends or is
closed, even if it never started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
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
from tenants.errors import LimiterUnavailableError, QuotaExceededError, RateLimitedError, TenantError
from versions.routing import ModelRouter, Target

log = logging.getLogger("sluice.gateway")


@dataclass(frozen=True)
class Arrival:
    """When the request reached the gateway, on both clocks."""

    monotonic: float  # time.monotonic(): every duration of the request starts here
    wall: float  # time.time(): for the trace, beside the engine's own timestamps

    @classmethod
    def now(cls) -> Arrival:
        return cls(time.monotonic(), time.time())


def outcome_of(exc: BaseException) -> str:
    """The status a request that ended with `exc` is recorded with (usage, metrics, log)."""
    if isinstance(exc, asyncio.CancelledError):
        return "disconnected"
    if isinstance(exc, LifetimeExceededError):
        return "timeout"
    if isinstance(exc, RateLimitedError | LimiterUnavailableError):
        return "rate_limited"
    if isinstance(exc, QuotaExceededError):
        return "insufficient_quota"
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
        self,
        serving: Serving,
        request_id: str,
        caller: TenantContext | None,
        arrival: Arrival,
        model: str | None,
    ) -> None:
        self.serving = serving
        self.request_id = request_id
        self.caller = caller
        self.arrival = arrival
        self.dispatch: Dispatch | None = None
        self.ticket: Ticket | None = None
        self.completion: list[int] = []  # completion tokens of each choice, as last reported
        self._cached: list[int | None] = []  # each choice's prompt tokens the engine served from its cache
        self._model = model or ""  # what the body asked for, until the plan resolves it
        self._counted: dict[str, str] | None = None  # x-ratelimit-*-requests once the request counted
        self._usage_recorded = False  # the gate wrote the refusal's usage record itself
        self._pending: Pending | None = None
        self._timeline: RequestTimeline | None = None
        self._fanout: Fanout | None = None
        self._in_flight = False  # counted in the gauge
        self._dispatched: float | None = None  # time.monotonic() when the driver streams were opened
        self._first_chunks: float | None = None  # ... and when each had sent its first chunk
        self._handed_off = False  # a stream owns the scope now
        self._finished = False
        self._pinned: tuple[ModelRouter, Target] | None = None  # the version it holds a lease on

    @property
    def headers(self) -> dict[str, str]:
        """x-ratelimit-* headers for the response (requests: from the count; tokens: the ticket)."""
        return {**(self._counted or {}), **(self.ticket.headers if self.ticket is not None else {})}

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens served from the engine's prefix cache (usage.prompt_tokens_details), None when no
        engine said: per distinct prompt the most any of its choices found cached (they share it, as
        prompt_tokens counts it once), summed over the prompts of a batch."""
        dispatch = self.dispatch
        if dispatch is None or all(c is None for c in self._cached):
            return None
        per_prompt = [0] * len(dispatch.prompt_lengths)
        for choice, cached in enumerate(self._cached):
            if cached is not None:
                p = dispatch.prompt_of(choice)
                per_prompt[p] = max(per_prompt[p], cached)
        return sum(per_prompt)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first chunk of every choice; None before that."""
        return None if self._first_chunks is None else self._first_chunks - self.arrival.monotonic

    # -- before the engine -------------------------------------------------------------------------

    async def admit(self) -> None:
        """Count the request against the tenant's monthly budget and requests per minute before any
        expensive work: a request refused later (400 at dispatch, 503) still counts."""
        gate, caller = self.serving.gate, self.caller
        if gate is None or caller is None:
            return
        try:
            self._counted = await gate.count(caller, self.request_id, self._model)
        except TenantError:
            self._usage_recorded = True
            raise

    def pin(self, router: ModelRouter) -> Target:
        """Resolve the model the request names to one version now (ModelNotFoundError: 404, also for a
        model the tenant may not use); the request holds that version until it finishes, so the
        version is not unloaded under it."""
        target = router.resolve(self._model or None, self.caller.tenant_id if self.caller is not None else None)
        self._pinned = (router, target)
        return target

    async def prepare(self, plan: Callable[[], Plan]) -> Dispatch:
        """Check the request (`plan`: no tokenizing), then tokenize each distinct prompt once; the
        tenant's tier becomes the engine priority."""
        checked = plan()
        self._model = checked.card.id
        dispatch = await checked.tokenize(self.serving.driver, self.serving.settings.max_default_tokens)
        caller = self.caller
        if caller is not None:
            # The tenant's tier orders its work in the engine (lower = sooner); see tenants.models. A
            # request's own `priority` may only lower its importance below the tier, never raise it.
            requests = [
                msgspec.structs.replace(
                    r, priority=max(caller.priority, r.priority), tenant_id=caller.tenant_id,
                    tenant_weight=caller.weight,  # its fair share within the tier (engine_native/fair_queue.py)
                )
                for r in dispatch.requests
            ]
            dispatch = dataclasses.replace(dispatch, requests=requests)
        self.dispatch = dispatch
        self.completion = [0] * len(dispatch.requests)
        self._cached = [None] * len(dispatch.requests)
        return dispatch

    async def reserve(self) -> None:
        """Refuse now (OverloadedError: 503 + Retry-After) what would miss its tier's TTFT target;
        then the tenant's ticket: prompt + max_tokens from its token bucket (finish refunds what
        goes unused) and a concurrency slot per sequence (prompts x n)."""
        dispatch = self._dispatch()
        serving = self.serving
        first = dispatch.requests[0]
        max_tokens = sum(r.max_tokens or 0 for r in dispatch.requests)
        health = await serving.driver.health()
        try:
            self._pending = serving.shedder.admit(health, first.priority, dispatch.prompt_tokens, max_tokens)
        except DriverError as exc:
            log.info("shed", extra={"request_id": self.request_id, "priority": first.priority,
                                    "reason": getattr(exc, "reason", "overloaded"), "detail": str(exc)})
            await self.finish("shed")
            raise
        gate, caller = serving.gate, self.caller
        if gate is None or caller is None:
            return
        try:
            ticket = await gate.admit(
                caller, self.request_id, dispatch.model, dispatch.prompt_tokens + max_tokens,
                sequences=len(dispatch.requests), counted=True,
            )
        except TenantError:
            self._usage_recorded = True
            raise
        ticket.started = self.arrival.monotonic  # usage latency from arrival, like every figure here
        self.ticket = ticket

    # -- the engine ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Start the driver streams and wait for the first chunk of every choice; errors so far are
        plain JSON responses."""
        dispatch = self._dispatch()
        serving = self.serving
        loop = asyncio.get_running_loop()
        self._dispatched = time.monotonic()
        # The lifetime cap counts from arrival too: time spent before dispatch is the client's wait.
        deadline = loop.time() + serving.settings.stream_timeout_s - (self._dispatched - self.arrival.monotonic)
        requests = dispatch.requests
        if serving.observability is not None:
            tenant = self.caller.tenant_id if self.ticket is not None and self.caller is not None else None
            operation = "chat" if self.request_id.startswith("chatcmpl") else "text_completion"
            self._timeline = timeline = serving.observability.start(
                self.request_id, dispatch.model, operation, dispatch.requests, tenant, TRACE_PARENT.get(),
                arrived=self.arrival.wall,
            )
            if timeline.trace_id is not None:  # tracing on: each choice's span is the parent downstream
                requests = [msgspec.structs.replace(r, trace_parent=timeline.downstream_trace_parent(i))
                            for i, r in enumerate(requests)]
        self._fanout = Fanout(serving.driver, requests, deadline=deadline)
        serving.metrics.in_flight.inc()
        self._in_flight = True
        await self._fanout.open()
        self._first_chunks = time.monotonic()
        if self._pending is not None:
            serving.shedder.started(self._pending)
        serving.metrics.ttft.labels(model=dispatch.model).observe(self._first_chunks - self.arrival.monotonic)

    async def chunks(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """Every chunk of every choice, recorded (timeline, completion tokens) before it is yielded."""
        assert self._fanout is not None, "open() first"
        timeline = self._timeline
        async for i, chunk in self._fanout.chunks():
            self.completion[i] = chunk.completion_tokens
            if chunk.cached_tokens is not None:
                self._cached[i] = chunk.cached_tokens
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

    def charged(self) -> tuple[int, int]:
        """(prompt, completion) tokens the engine computed for this request, each counted once.

        A prompt counts once its prefill produced a token for any of its choices (the n choices share
        it; a recompute after preemption is not a second prefill); completion tokens are the engine's
        running totals as last reported, which a recompute does not change."""
        dispatch = self.dispatch
        if dispatch is None:
            return 0, 0
        prefilled = {dispatch.prompt_of(i) for i, tokens in enumerate(self.completion) if tokens > 0}
        return sum(dispatch.prompt_lengths[p] for p in prefilled), sum(self.completion)

    async def finish(self, outcome: str) -> None:
        """Give back everything the request holds and charge what ran; the first call wins."""
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
        if self._pinned is not None:
            router, target = self._pinned
            router.release(target)
        prompt, completion = self.charged()
        ended = time.monotonic()
        ttft = self.ttft
        if self._first_chunks is not None:  # a generation: it reached the engine's first tokens
            metrics, model = serving.metrics, self._model
            metrics.prompt_tokens.labels(model=model).inc(prompt)
            metrics.completion_tokens.labels(model=model).inc(completion)
            metrics.e2e.labels(model=model).observe(ended - self.arrival.monotonic)
        telemetry = self._end_timeline(outcome)
        caller = self.caller
        dispatch = self.dispatch
        log.info(
            "request finished",
            extra={
                "request_id": self.request_id,
                "model": self._model,
                "n": len(dispatch.requests) if dispatch is not None else None,  # sequences: prompts x n
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "outcome": outcome,
                # Every duration from arrival; dispatch_s is the gateway's share before the engine.
                "duration_s": round(ended - self.arrival.monotonic, 4),
                "ttft_s": None if ttft is None else round(ttft, 4),
                "dispatch_s": None if self._dispatched is None else round(self._dispatched - self.arrival.monotonic, 4),
                "tenant": caller.tenant_id if caller is not None else None,
                **telemetry,
                # Dropped by the log formatter unless SLUICE_LOG_PROMPTS=1; built only then.
                **({"prompt": [r.prompt or r.messages or r.prompt_token_ids for r in dispatch.requests]}
                   if serving.settings.log_prompts and dispatch is not None else {}),
            },
        )
        gate = serving.gate
        if gate is None or caller is None:
            return
        if self.ticket is None:  # refused before its ticket: nothing reserved, only the record
            if not self._usage_recorded:
                gate.refuse(caller, self.request_id, self._model, outcome)
        elif prompt or completion:
            await _settle(gate.finish(self.ticket, prompt, completion, ttft, outcome))
        else:  # nothing ran: every reserved token back
            await _settle(gate.cancel(self.ticket, outcome))

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

    def _dispatch(self) -> Dispatch:
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

    def __anext__(self) -> Awaitable[bytes]:
        return self._events.__anext__()  # the generator's own awaitable: no frame of ours per chunk

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
