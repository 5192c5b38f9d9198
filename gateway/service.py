"""The completion service: validated OpenAI request in, OpenAI response or SSE byte stream out.

Route handlers call `chat()` / `completion()` and only wrap the result in an
HTTP response. Everything a driver rejects up front raises here, before any
byte is sent; errors after the stream has started become an SSE error event.

A request runs inside one `RequestScope` (gateway/request_scope.py), which holds
what it takes on the way and gives it all back once, in `finish()`:

    admit (count the request: 429) -> prepare (check, tokenize once: 400/404)
        -> reserve (shed: 503; the tenant's tokens: 429) -> open (the driver, first chunks)
        -> stream or collect -> finish(outcome): charge what ran, refund the rest, record; once
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from drivers.base import Driver, DriverError
from gateway.admission import TenantGate
from gateway.cold_start import ColdStartHold, Readiness
from gateway.errors import error_from_driver
from gateway.fanout import LifetimeExceededError
from gateway.load_shedding import LoadShedder, SheddingPolicy
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
from gateway.request_scope import Arrival, RequestScope, Serving
from gateway.schemas import ChatCompletionRequest, CompletionRequest, ErrorDetail
from gateway.settings import Settings
from gateway.validation import Dispatch, Plan, chat_plan, completion_plan
from observability.hub import Observability
from tenants.auth import TenantContext
from tenants.models import STANDARD
from versions.routing import ModelRouter, Target

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
        # What a model name means now (the model registry, versions/); empty: every name passes through.
        self.models = ModelRouter()
        self.shedder = LoadShedder(
            SheddingPolicy(settings.ttft_targets_s, settings.queue_share, settings.load_shedding), metrics
        )
        # No ready worker: requests wait here for one, bounded per tier and in time (scale from zero).
        self.cold_start = ColdStartHold(settings.cold_start, self._driver_ready, metrics)

    async def _driver_ready(self) -> Readiness:
        health = await self.driver.health()
        if health.ready:
            return Readiness.READY
        return Readiness.STARTING if health.starting and health.live else Readiness.DOWN

    async def chat(
        self,
        body: ChatCompletionRequest,
        rid: str,
        caller: TenantContext | None = None,
        arrival: Arrival | None = None,
    ) -> Reply:
        """`arrival`: when the request reached the gateway (default: now)."""
        return await self._serve(body, rid, caller, arrival, chat_plan, ChatChunks, chat_completion)

    async def completion(
        self,
        body: CompletionRequest,
        rid: str,
        caller: TenantContext | None = None,
        arrival: Arrival | None = None,
    ) -> Reply:
        return await self._serve(body, rid, caller, arrival, completion_plan, CompletionChunks, text_completion)

    async def _serve(
        self,
        body: _Body,
        rid: str,
        caller: TenantContext | None,
        arrival: Arrival | None,
        plan: Callable[[_Body, str, Driver], Plan],
        chunks: type[ChatChunks | CompletionChunks],
        whole: Callable[[str, int, str, list[ChoiceOutput], int, int | None, bool, str | None], msgspec.Struct],
    ) -> Reply:
        """The one path of both endpoints: admit, prepare, reserve, open, then stream or collect."""
        if caller is None and body.priority is None:
            # Without auth nobody has a tier: a request is standard unless it says otherwise. The premium
            # tier's tight TTFT target would refuse loads the server can serve.
            body = msgspec.structs.replace(body, priority=STANDARD)
        serving = Serving(self.driver, self.settings, self.metrics, self.shedder, self.gate, self.observability)
        async with RequestScope(serving, rid, caller, arrival or Arrival.now(), body.model) as scope:
            await scope.admit()
            # Before the plan: checking and tokenizing need a worker's model. The tier as prepare() sets it.
            tier = max(caller.priority if caller is not None else 0, body.priority or 0)
            await self.cold_start.wait(tier)
            # Pinned here, once: the whole request runs on the version the alias meant at this moment.
            target = scope.pin(self.models)
            body = msgspec.structs.replace(body, model=target.model_id)
            dispatch = await scope.prepare(lambda: plan(body, rid, self.driver))
            await scope.reserve()
            await scope.open()
            created = int(time.time())
            logprobs = dispatch.logprobs is not None
            fingerprint = target.fingerprint
            if body.stream:
                include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
                renderer = chunks(rid, created, dispatch.model, fingerprint)
                events = _events(scope, dispatch, renderer, include_usage, logprobs)
                return Reply(scope.stream(events), {**scope.headers, **_version_headers(target)})
            outputs = [ChoiceOutput() for _ in dispatch.requests]
            async for i, chunk in scope.chunks():
                outputs[i].add(chunk)
        body_out = whole(rid, created, dispatch.model, outputs, dispatch.prompt_tokens, scope.cached_tokens, logprobs,
                         fingerprint)
        return Reply(body_out, {**scope.headers, **_version_headers(target)})


def _version_headers(target: Target) -> dict[str, str]:
    """The alias generation that chose the serving version (the body's `model` names the version)."""
    return {} if target.generation is None else {"x-sluice-model-generation": str(target.generation)}


async def _events(
    scope: RequestScope,
    dispatch: Dispatch,
    renderer: ChatChunks | CompletionChunks,
    include_usage: bool,
    logprobs: bool,
) -> AsyncGenerator[bytes, None]:
    """The SSE stream of an opened request; it finishes the scope when it ends."""
    outcome = "disconnected"  # stays so unless we reach the end or an error below
    try:
        if isinstance(renderer, ChatChunks):
            for i in range(len(dispatch.requests)):
                yield renderer.role(i)
        async for i, chunk in scope.chunks():
            data = renderer.delta(i, chunk, logprobs)
            if data is not None:
                yield data
        if include_usage:
            yield renderer.usage(dispatch.prompt_tokens, sum(scope.completion), scope.cached_tokens)
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
        await scope.finish(outcome)
