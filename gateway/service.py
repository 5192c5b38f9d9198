"""The completion service: validated OpenAI request in, OpenAI response or SSE byte stream out.

Route handlers call `chat()` / `completion()` and only wrap the result in an
HTTP response. Everything a driver rejects up front raises here, before any
byte is sent; errors after the stream has started become an SSE error event.

With a tenant gate (auth on), a request from `caller` runs:

    dispatch (count prompt tokens) -> shed? (estimated queue wait vs the tier's TTFT target, 503)
        -> gate.admit(prompt + max_tokens) -> driver
        -> finally gate.finish(actual tokens, status): refund + usage record, once
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from drivers.base import Driver, DriverError
from gateway.admission import TenantGate, Ticket
from gateway.errors import error_from_driver
from gateway.fanout import Fanout, LifetimeExceededError
from gateway.load_shedding import LoadShedder, Pending, SheddingPolicy
from gateway.metrics import GatewayMetrics
from gateway.render import (
    SSE_DONE,
    ChatChunks,
    ChoiceOutput,
    CompletionChunks,
    chat_completion,
    sse_error,
    text_completion,
)
from gateway.schemas import ChatCompletionRequest, CompletionRequest, ErrorDetail
from gateway.settings import Settings
from gateway.validation import Dispatch, chat_dispatch, completion_dispatch
from observability.hub import TRACE_PARENT, Observability
from observability.timeline import RequestTimeline
from tenants.auth import TenantContext

log = logging.getLogger("sluice.gateway")

_Body = TypeVar("_Body", ChatCompletionRequest, CompletionRequest)


@dataclass(frozen=True)
class Reply:
    """A whole response or an SSE byte stream, plus headers for the HTTP response (x-ratelimit-*)."""

    body: msgspec.Struct | AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)


class CompletionService:
    def __init__(
        self, driver: Driver, settings: Settings, metrics: GatewayMetrics, gate: TenantGate | None = None
    ) -> None:
        self.driver = driver
        self.settings = settings
        self.metrics = metrics
        self.gate = gate  # None: auth is off, nothing is limited or recorded
        self.observability: Observability | None = None  # create_app sets it; None: request metrics off
        self._timelines: dict[str, RequestTimeline] = {}  # running requests, for metrics and traces
        self.shedder = LoadShedder(
            SheddingPolicy(settings.ttft_targets_s, settings.queue_share, settings.load_shedding), metrics
        )
        self._pending: dict[str, Pending] = {}  # admitted by the shedder and not finished

    async def chat(self, body: ChatCompletionRequest, rid: str, caller: TenantContext | None = None) -> Reply:
        return await self._serve(body, rid, caller, chat_dispatch, ChatChunks, chat_completion)

    async def completion(
        self, body: CompletionRequest, rid: str, caller: TenantContext | None = None
    ) -> Reply:
        return await self._serve(body, rid, caller, completion_dispatch, CompletionChunks, text_completion)

    async def _serve(
        self,
        body: _Body,
        rid: str,
        caller: TenantContext | None,
        build: Callable[[_Body, str, Driver, int], Dispatch],
        chunks: type[ChatChunks | CompletionChunks],
        whole: Callable[[str, int, str, list[ChoiceOutput], int, bool], msgspec.Struct],
    ) -> Reply:
        """The one path of both endpoints: dispatch, shed or admit, then stream or collect."""
        cap = self.settings.max_default_tokens
        dispatch = self._dispatch(lambda: build(body, rid, self.driver, cap), caller, rid, body.model)
        ticket = await self._shed_or_admit(dispatch, caller)
        created = int(time.time())
        logprobs = dispatch.logprobs is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            renderer = chunks(rid, created, dispatch.model)
            return await self._stream(dispatch, ticket, renderer, include_usage, logprobs)
        outputs = await self._collect(dispatch, ticket)
        return Reply(whole(rid, created, dispatch.model, outputs, dispatch.prompt_tokens, logprobs), _headers(ticket))

    # -- tenancy ---------------------------------------------------------------------------------

    def _dispatch(
        self, build: Callable[[], Dispatch], caller: TenantContext | None, rid: str, model: str | None
    ) -> Dispatch:
        try:
            dispatch = build()
        except DriverError as exc:
            if self.gate is not None and caller is not None:
                self.gate.refuse(caller, rid, model or "", type(exc).__name__)
            raise
        if caller is None:
            return dispatch
        # The tenant's tier orders its work in the engine (lower = sooner); see tenants.models. A request's
        # own `priority` may only lower its importance below the tier, never raise it.
        requests = [
            msgspec.structs.replace(r, priority=max(caller.priority, r.priority), tenant_id=caller.tenant_id)
            for r in dispatch.requests
        ]
        return Dispatch(
            dispatch.request_id, dispatch.model, requests, dispatch.prompt_tokens, dispatch.logprobs
        )

    async def _shed_or_admit(self, dispatch: Dispatch, caller: TenantContext | None) -> Ticket | None:
        """Refuse now (OverloadedError: 503 + Retry-After) what would miss its tier's TTFT target; then
        the tenant's limits. The shedder counts the request until it finishes (`_finished`)."""
        first = dispatch.requests[0]
        max_tokens = sum(r.max_tokens or 0 for r in dispatch.requests)
        health = await self.driver.health()
        try:
            pending = self.shedder.admit(health, first.priority, dispatch.prompt_tokens, max_tokens)
        except DriverError as exc:
            if self.gate is not None and caller is not None:
                self.gate.refuse(caller, dispatch.request_id, dispatch.model, "shed")
            log.info("shed", extra={"request_id": dispatch.request_id, "priority": first.priority,
                                    "reason": getattr(exc, "reason", "overloaded"), "detail": str(exc)})
            raise
        try:
            ticket = await self._admit(dispatch, caller)
        except BaseException:
            self.shedder.finished(pending)
            raise
        self._pending[dispatch.request_id] = pending
        return ticket

    async def _admit(self, dispatch: Dispatch, caller: TenantContext | None) -> Ticket | None:
        if self.gate is None or caller is None:
            return None
        # Reserve the worst case; finish() refunds what the completion did not use.
        tokens = dispatch.prompt_tokens + sum(r.max_tokens or 0 for r in dispatch.requests)
        return await self.gate.admit(caller, dispatch.request_id, dispatch.model, tokens)

    # -- running a dispatch ----------------------------------------------------------------------

    async def _open(self, dispatch: Dispatch, ticket: Ticket | None) -> tuple[Fanout, float, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        fanout = Fanout(self.driver, dispatch.requests, deadline=started + self.settings.stream_timeout_s)
        if self.observability is not None:
            tenant = ticket.caller.tenant_id if ticket is not None else None
            operation = "chat" if dispatch.request_id.startswith("chatcmpl") else "text_completion"
            self._timelines[dispatch.request_id] = self.observability.start(
                dispatch.request_id, dispatch.model, operation, dispatch.requests, tenant, TRACE_PARENT.get()
            )
        self.metrics.in_flight.inc()
        try:
            await fanout.open()
        except BaseException as exc:
            self.metrics.in_flight.dec()
            self._end_timeline(dispatch.request_id, type(exc).__name__)
            pending = self._pending.pop(dispatch.request_id, None)
            if pending is not None:
                self.shedder.finished(pending)
            if ticket is not None and self.gate is not None:
                await _settle(self.gate.finish(ticket, dispatch.prompt_tokens, 0, None, type(exc).__name__))
            raise
        pending = self._pending.get(dispatch.request_id)
        if pending is not None:
            self.shedder.started(pending)
        ttft = loop.time() - started
        self.metrics.ttft.labels(model=dispatch.model).observe(ttft)
        return fanout, started, ttft

    async def _collect(self, dispatch: Dispatch, ticket: Ticket | None) -> list[ChoiceOutput]:
        fanout, started, ttft = await self._open(dispatch, ticket)
        outputs = [ChoiceOutput() for _ in dispatch.requests]
        timeline = self._timelines.get(dispatch.request_id)
        outcome = "error"
        try:
            async for i, chunk in fanout.chunks():
                outputs[i].add(chunk)
                if timeline is not None:
                    timeline.add(i, chunk)
            outcome = "ok"
        except BaseException as exc:
            outcome = "disconnected" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
            raise
        finally:
            await fanout.aclose()
            completion = [o.completion_tokens for o in outputs]
            await self._finished(dispatch, ticket, completion, started, ttft, outcome)
        return outputs

    async def _stream(
        self,
        dispatch: Dispatch,
        ticket: Ticket | None,
        renderer: ChatChunks | CompletionChunks,
        include_usage: bool,
        logprobs: bool,
    ) -> Reply:
        fanout, started, ttft = await self._open(dispatch, ticket)  # errors so far are plain JSON responses
        events = self._events(dispatch, ticket, fanout, started, ttft, renderer, include_usage, logprobs)
        return Reply(events, _headers(ticket))

    async def _events(
        self,
        dispatch: Dispatch,
        ticket: Ticket | None,
        fanout: Fanout,
        started: float,
        ttft: float,
        renderer: ChatChunks | CompletionChunks,
        include_usage: bool,
        logprobs: bool,
    ) -> AsyncIterator[bytes]:
        completion = [0] * len(dispatch.requests)
        timeline = self._timelines.get(dispatch.request_id)
        outcome = "disconnected"  # stays so unless we reach the end or an error below
        try:
            if isinstance(renderer, ChatChunks):
                for i in range(len(dispatch.requests)):
                    yield renderer.role(i)
            async for i, chunk in fanout.chunks():
                completion[i] = chunk.completion_tokens
                if timeline is not None:
                    timeline.add(i, chunk)
                data = renderer.delta(i, chunk, logprobs)
                if data is not None:
                    yield data
            if include_usage:
                yield renderer.usage(dispatch.prompt_tokens, sum(completion))
            outcome = "ok"
            yield SSE_DONE
        except DriverError as exc:  # e.g. the engine died mid-stream: the status line is long gone
            outcome = type(exc).__name__
            yield sse_error(error_from_driver(exc, dispatch.request_id)[1])
            yield SSE_DONE
        except LifetimeExceededError as exc:
            outcome = "timeout"
            yield sse_error(ErrorDetail(str(exc), "timeout_error", None, "stream_timeout"))
            yield SSE_DONE
        except Exception:
            outcome = "error"
            log.exception("stream failed", extra={"request_id": dispatch.request_id})
            yield sse_error(ErrorDetail("Internal server error", "server_error"))
            yield SSE_DONE
        finally:
            await fanout.aclose()  # client gone or done: abort and release everything
            await self._finished(dispatch, ticket, completion, started, ttft, outcome)

    def _end_timeline(self, request_id: str, outcome: str) -> dict[str, object]:
        """Metrics and trace of a request that ended; returns fields for its log line (node, trace id)."""
        timeline = self._timelines.pop(request_id, None)
        if timeline is None or self.observability is None:
            return {}
        try:
            return self.observability.finish(timeline, outcome)
        except Exception:
            log.exception("recording telemetry failed", extra={"request_id": request_id})
            return {}

    async def _finished(
        self,
        dispatch: Dispatch,
        ticket: Ticket | None,
        completion: list[int],
        started: float,
        ttft: float,
        outcome: str,
    ) -> None:
        self.metrics.in_flight.dec()
        pending = self._pending.pop(dispatch.request_id, None)
        if pending is not None:
            self.shedder.finished(pending)
        total = sum(completion)
        self.metrics.prompt_tokens.labels(model=dispatch.model).inc(dispatch.prompt_tokens)
        self.metrics.completion_tokens.labels(model=dispatch.model).inc(total)
        elapsed = asyncio.get_running_loop().time() - started
        self.metrics.e2e.labels(model=dispatch.model).observe(elapsed)
        extra = self._end_timeline(dispatch.request_id, outcome)
        log.info(
            "generation finished",
            extra={
                "request_id": dispatch.request_id,
                "model": dispatch.model,
                "n": len(dispatch.requests),
                "prompt_tokens": dispatch.prompt_tokens,
                "completion_tokens": total,
                "outcome": outcome,
                "duration_s": round(elapsed, 4),
                "tenant": ticket.caller.tenant_id if ticket else None,
                **extra,
                # Dropped by the log formatter unless SLUICE_LOG_PROMPTS=1; built only then.
                **({"prompt": [r.prompt or r.messages or r.prompt_token_ids for r in dispatch.requests]}
                   if self.settings.log_prompts else {}),
            },
        )
        if ticket is not None and self.gate is not None:
            await _settle(self.gate.finish(ticket, dispatch.prompt_tokens, total, ttft, outcome))


def _headers(ticket: Ticket | None) -> dict[str, str]:
    return ticket.headers if ticket is not None else {}


async def _settle(release: asyncio.Task[None] | None) -> None:
    """Wait for a refund so the next request (on any replica) sees it; shielded, because a client
    disconnect cancels us and the refund must complete regardless."""
    if release is not None:
        await asyncio.shield(release)
