"""The completion service: validated OpenAI request in, OpenAI response or SSE byte stream out.

Route handlers call `chat()` / `completion()` and only wrap the result in an
HTTP response. Everything a driver rejects up front raises here, before any
byte is sent; errors after the stream has started become an SSE error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from drivers.base import Driver, DriverError
from gateway.errors import error_from_driver
from gateway.fanout import Fanout, LifetimeExceededError
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
from gateway.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorDetail
from gateway.settings import Settings
from gateway.validation import Dispatch, chat_dispatch, completion_dispatch

log = logging.getLogger("sluice.gateway")


class CompletionService:
    def __init__(self, driver: Driver, settings: Settings, metrics: GatewayMetrics) -> None:
        self.driver = driver
        self.settings = settings
        self.metrics = metrics

    async def chat(self, body: ChatCompletionRequest, rid: str) -> ChatCompletion | AsyncIterator[bytes]:
        dispatch = chat_dispatch(body, rid, self.driver, self.settings.max_default_tokens)
        created = int(time.time())
        logprobs = dispatch.logprobs is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await self._stream(
                dispatch, ChatChunks(rid, created, dispatch.model), include_usage, logprobs
            )
        outputs = await self._collect(dispatch)
        return chat_completion(rid, created, dispatch.model, outputs, dispatch.prompt_tokens, logprobs)

    async def completion(self, body: CompletionRequest, rid: str) -> Completion | AsyncIterator[bytes]:
        dispatch = completion_dispatch(body, rid, self.driver, self.settings.max_default_tokens)
        created = int(time.time())
        logprobs = dispatch.logprobs is not None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            renderer = CompletionChunks(rid, created, dispatch.model)
            return await self._stream(dispatch, renderer, include_usage, logprobs)
        outputs = await self._collect(dispatch)
        return text_completion(rid, created, dispatch.model, outputs, dispatch.prompt_tokens, logprobs)

    # -- running a dispatch ----------------------------------------------------------------------

    async def _open(self, dispatch: Dispatch) -> tuple[Fanout, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        fanout = Fanout(self.driver, dispatch.requests, deadline=started + self.settings.stream_timeout_s)
        self.metrics.in_flight.inc()
        try:
            await fanout.open()
        except BaseException:
            self.metrics.in_flight.dec()
            raise
        self.metrics.ttft.labels(model=dispatch.model).observe(loop.time() - started)
        return fanout, started

    async def _collect(self, dispatch: Dispatch) -> list[ChoiceOutput]:
        fanout, started = await self._open(dispatch)
        outputs = [ChoiceOutput() for _ in dispatch.requests]
        outcome = "error"
        try:
            async for i, chunk in fanout.chunks():
                outputs[i].add(chunk)
            outcome = "ok"
        finally:
            await fanout.aclose()
            self._finished(dispatch, [o.completion_tokens for o in outputs], started, outcome)
        return outputs

    async def _stream(
        self, dispatch: Dispatch, renderer: ChatChunks | CompletionChunks, include_usage: bool, logprobs: bool
    ) -> AsyncIterator[bytes]:
        fanout, started = await self._open(dispatch)  # errors so far are plain JSON responses
        return self._events(dispatch, fanout, started, renderer, include_usage, logprobs)

    async def _events(
        self,
        dispatch: Dispatch,
        fanout: Fanout,
        started: float,
        renderer: ChatChunks | CompletionChunks,
        include_usage: bool,
        logprobs: bool,
    ) -> AsyncIterator[bytes]:
        completion = [0] * len(dispatch.requests)
        outcome = "disconnected"  # stays so unless we reach the end or an error below
        try:
            if isinstance(renderer, ChatChunks):
                for i in range(len(dispatch.requests)):
                    yield renderer.role(i)
            async for i, chunk in fanout.chunks():
                completion[i] = chunk.completion_tokens
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
            self._finished(dispatch, completion, started, outcome)

    def _finished(self, dispatch: Dispatch, completion: list[int], started: float, outcome: str) -> None:
        self.metrics.in_flight.dec()
        total = sum(completion)
        self.metrics.prompt_tokens.labels(model=dispatch.model).inc(dispatch.prompt_tokens)
        self.metrics.completion_tokens.labels(model=dispatch.model).inc(total)
        elapsed = asyncio.get_running_loop().time() - started
        self.metrics.e2e.labels(model=dispatch.model).observe(elapsed)
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
            },
        )
