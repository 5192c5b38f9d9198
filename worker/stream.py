"""One generate response on the wire: the driver's chunks in, JSON-line frames out.

    driver chunks ──reader──> pending ──writer──> one TokensEvent per frame ──> gateway
                                          ▲
                     keepalive ticker ────┘ (a KeepAlive line whenever no line went out for keepalive_s)

The writer sends whatever has piled up since its last frame, merged into one `TokensEvent`: every
token that was ready when the stream is written goes in one frame. A frame costs the gateway one
HTTP read and one decode however many tokens it holds, so under load (chunks pile up while the
writer waits its turn) the per-token cost on both sides falls instead of the event loops falling
behind. `interval_s` > 0 also holds a frame back until `interval_s` after the previous one (the
first tokens and the last are never held). The engine's time of every token travels in
`token_times`, so the gateway's inter-token figures stay per token.

The gateway hanging up (`http.disconnect`) ends it: the reader is cancelled and the caller closes
the driver's stream, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from drivers.base import DriverError, GenerationChunk, TokenLogprob
from drivers.fleet import wire
from drivers.fleet.wire import ErrorBody

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class TokenStream:
    def __init__(self, first: asyncio.Future[GenerationChunk | None], chunks: AsyncIterator[GenerationChunk],
                 send: Send, receive: Receive, refusal: Callable[[DriverError], ErrorBody], *,
                 deadline: float | None, keepalive_s: float, interval_s: float) -> None:
        self.first, self.chunks = first, chunks
        self.send, self.receive, self.refusal = send, receive, refusal
        self.deadline, self.keepalive_s, self.interval_s = deadline, keepalive_s, interval_s
        self.tokens_sent = 0
        self.frames_sent = 0
        self._pending: list[GenerationChunk] = []
        self._ready = asyncio.Event()  # the reader appended something, failed or ended
        self._read_done = False
        self._failure: DriverError | None = None
        self._last_line = asyncio.get_running_loop().time()

    async def run(self) -> str:
        """Pump until the request ends or the gateway hangs up; returns how it ended (a metric label)."""
        reader = asyncio.create_task(self._read())
        writer = asyncio.create_task(self._write())
        gone = asyncio.create_task(_disconnected(self.receive))
        ticker = asyncio.create_task(self._keepalives())
        try:
            done, _ = await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer, gone, ticker):
                task.cancel()
            await asyncio.gather(reader, writer, gone, ticker, return_exceptions=True)
        if writer in done and not writer.cancelled() and writer.exception() is None:
            with contextlib.suppress(OSError):
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            return writer.result()
        return "disconnected"

    async def _read(self) -> None:
        try:
            chunk = await self.first
            while chunk is not None:
                self._pending.append(chunk)
                self._ready.set()
                if chunk.finish_reason is not None:
                    break
                chunk = await anext(self.chunks, None)
        except DriverError as exc:
            self._failure = exc
        finally:
            self._read_done = True
            self._ready.set()

    async def _write(self) -> str:
        loop = asyncio.get_running_loop()
        last_frame = -float("inf")
        while True:
            await self._ready.wait()
            self._ready.clear()
            held = last_frame + self.interval_s - loop.time()
            if held > 0 and self._pending and not self._read_done and self.frames_sent:
                await asyncio.sleep(held)  # more tokens may come meanwhile: they ride in this frame
            batch, self._pending = self._pending, []
            if batch:
                if self.deadline is not None and time.time() > self.deadline:
                    await self._line(wire.FailureEvent(kind=wire.ErrorKind.OVERLOADED, message="deadline passed"))
                    return "deadline"
                last_frame = loop.time()
                await self._line(merged_event(batch))
                self.frames_sent += 1
                self.tokens_sent += sum(len(c.token_ids) for c in batch)
                if batch[-1].finish_reason is not None:
                    return "finished"
            if self._read_done and not self._pending:
                if self._failure is not None:
                    body = self.refusal(self._failure)
                    await self._line(wire.FailureEvent(kind=body.kind, message=body.message,
                                                       retry_after=body.retry_after))
                    return str(body.kind)
                return "ended"

    async def _keepalives(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, self._last_line + self.keepalive_s - loop.time()))
            if loop.time() - self._last_line >= self.keepalive_s:
                await self._line(wire.KeepAlive(time.time()))

    async def _line(self, event: wire.StreamEvent) -> None:
        self._last_line = asyncio.get_running_loop().time()
        await self.send({"type": "http.response.body", "body": wire.encode_line(event), "more_body": True})


def merged_event(chunks: list[GenerationChunk]) -> wire.TokensEvent:
    """Consecutive chunks of one request as one event: tokens and text in order, each token with its
    chunk's time, counts and times of the last (the finishing chunk carries the request's times)."""
    last = chunks[-1]
    token_ids: list[int] = []
    token_times: list[float] = []
    logprobs: list[TokenLogprob] | None = None
    now = time.time()
    for c in chunks:
        token_ids.extend(c.token_ids)
        token_times.extend([c.token_time or now] * len(c.token_ids))
        if c.logprobs is not None:
            logprobs = (logprobs or []) + c.logprobs
    return wire.TokensEvent(
        token_ids=token_ids, text="".join(c.text for c in chunks), token_times=token_times,
        prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
        finish_reason=last.finish_reason, logprobs=logprobs, arrival_time=last.arrival_time,
        first_scheduled_time=last.first_scheduled_time, first_token_time=last.first_token_time,
        finish_time=last.finish_time, preemption_times=last.preemption_times, cached_tokens=last.cached_tokens,
    )


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
