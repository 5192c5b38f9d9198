"""OpenAI-compatible endpoints. Handlers decode, call the service, wrap the result; nothing more.

The completion routes stamp each request's arrival (`stamp_arrival`) before anything else runs for
it, the key check and body read included, so that every latency the gateway reports starts there.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency
from litestar.openapi import ResponseSpec
from litestar.response import Stream
from litestar.types import ASGIApp, Receive, Scope, Send

from drivers.base import Driver
from gateway.auth import TENANT_SECURITY
from gateway.errors import invalid_body
from gateway.openapi import error_responses, self_decoded_body
from gateway.request_scope import Arrival
from gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    ModelObject,
)
from gateway.service import CompletionService, Reply
from observability.hub import TRACE_PARENT
from tenants.auth import TenantContext

T = TypeVar("T")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


_ARRIVAL = "sluice_arrival"  # request.state key


def stamp_arrival(app: ASGIApp) -> ASGIApp:
    """Route middleware: it runs before the route's dependencies (the key check) and its handler."""

    async def stamped(scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})[_ARRIVAL] = Arrival.now()  # type: ignore[typeddict-unknown-key]
        await app(scope, receive, send)

    return stamped


def _arrival(request: Request) -> Arrival:
    arrival = request.state.get(_ARRIVAL)
    return arrival if isinstance(arrival, Arrival) else Arrival.now()


def _new_request_id(request: Request, prefix: str) -> str:
    rid = f"{prefix}-{uuid.uuid4().hex}"
    request.state["request_id"] = rid  # read by the error handlers so error responses carry it too
    TRACE_PARENT.set(request.headers.get("traceparent"))  # this request's trace continues the caller's
    return rid


async def _decode(request: Request, schema: type[T]) -> T:
    raw = await request.body()  # 413 past request_max_body_size, 408 past the body deadline
    try:
        # JSON nested too deep, even in a field we ignore, raises RecursionError: gateway.errors makes it 400
        return msgspec.json.decode(raw, type=schema)
    except msgspec.DecodeError as exc:
        raise invalid_body(exc) from None


async def _close_stream(events: AsyncIterator[bytes]) -> None:
    # Litestar cancels the stream on disconnect but never closes the iterator; when the cancel
    # lands while we are suspended at a `yield`, only this close runs our `finally` (abort +
    # release) at once rather than whenever the generator is garbage-collected.
    closer = getattr(events, "aclose", None)
    if closer is not None:
        await closer()


def _respond(reply: Reply, rid: str) -> Response[Any]:
    result = reply.body
    if isinstance(result, msgspec.Struct):
        return Response(
            msgspec.json.encode(result),
            media_type="application/json",
            headers={**reply.headers, "x-request-id": rid},
        )
    return Stream(
        result,
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **reply.headers, "x-request-id": rid},
        background=BackgroundTask(_close_stream, result),
    )


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response


async def _unless_disconnected(request: Request, work: Awaitable[Reply]) -> Reply | None:
    """Run `work`, cancelling it if the client disconnects first (None then).

    A non-streamed completion, or a streamed one still queued for its first token, sends nothing
    until it is done; without this watch a client that left would keep its request generating
    to the end. Cancelling runs the service's `finally` blocks: the engine aborts the request,
    its KV blocks are freed and the tenant's reservation is released.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()  # the body is read: what comes next is a disconnect
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and task.cancelled():
            return None
        raise
    finally:
        watcher.cancel()


def _reply(reply: Reply | None, rid: str) -> Response[Any]:
    if reply is None:
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)  # nobody is there to read it
    return _respond(reply, rid)


GENERATION_ERRORS = error_responses(400, 401, 403, 404, 408, 413, 429, 503, 504)


def _answer(body: type[msgspec.Struct]) -> ResponseSpec:
    return ResponseSpec(body, description="The whole answer, or with stream: true its chunks as server-sent "
                        "events", generate_examples=False)


@post(
    "/v1/chat/completions",
    status_code=200,
    security=TENANT_SECURITY,
    operation_class=self_decoded_body(ChatCompletionRequest),
    responses={200: _answer(ChatCompletion), **GENERATION_ERRORS},
    middleware=[stamp_arrival],
)
async def chat_completions(
    request: Request,
    service: NamedDependency[CompletionService],
    caller: NamedDependency[TenantContext | None],
) -> Response[Any]:
    rid = _new_request_id(request, "chatcmpl")
    body = await _decode(request, ChatCompletionRequest)
    reply = service.chat(body, rid, caller, _arrival(request))
    return _reply(await _unless_disconnected(request, reply), rid)


@post(
    "/v1/completions",
    status_code=200,
    security=TENANT_SECURITY,
    operation_class=self_decoded_body(CompletionRequest),
    responses={200: _answer(Completion), **GENERATION_ERRORS},
    middleware=[stamp_arrival],
)
async def completions(
    request: Request,
    service: NamedDependency[CompletionService],
    caller: NamedDependency[TenantContext | None],
) -> Response[Any]:
    rid = _new_request_id(request, "cmpl")
    body = await _decode(request, CompletionRequest)
    reply = service.completion(body, rid, caller, _arrival(request))
    return _reply(await _unless_disconnected(request, reply), rid)


@get("/v1/models", security=TENANT_SECURITY, responses=error_responses(401, 403))
async def list_models(
    driver: NamedDependency[Driver],
    service: NamedDependency[CompletionService],
    caller: NamedDependency[TenantContext | None],
) -> ModelList:
    """The public names: registry aliases and models served outside the registry, never version ids
    (`name@version` addresses a version without being listed)."""
    cards = service.models.public_cards(driver.models(), caller.tenant_id if caller is not None else None)
    return ModelList(data=[ModelObject(c.id, c.created, c.owned_by, c.max_model_len) for c in cards])


OPENAI_ROUTES = [chat_completions, completions, list_models]
