"""Running the n driver streams of one API request together.

`Fanout.open()` waits for the first chunk of every stream, so anything a driver
rejects up front (overloaded, bad request) surfaces before the HTTP response
starts and becomes a plain JSON error instead of a broken 200 stream. After
that, `chunks()` merges the streams, tagged with their choice index.
`aclose()` is idempotent and releases everything: it cancels the pumps and
closes every driver iterator, which aborts unfinished requests in the engine.
The lifetime cap over the chunks is one timer a request (`_Lifetime`), not a
timeout around each chunk's wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar, cast

from drivers.base import Driver, GenerationChunk, GenerationRequest

_END = None  # queue marker: one stream finished
T = TypeVar("T")


class LifetimeExceededError(Exception):
    """The generation ran past the gateway's per-request lifetime cap."""


class _Lifetime:
    """A request's lifetime cap over its chunk waits: one timer, armed at the first wait.

    `asyncio.timeout_at` around each wait made and cancelled a timer handle and looked up the running
    loop and task (a getpid() system call each on Python 3.11) for every streamed token. Here the
    timer cancels the task only while it waits for a chunk, as that timeout did: between waits (the
    consumer writing the last chunk out) it just marks the request expired, and the next wait raises.
    Another cancel of the task (the client left) stays a CancelledError, counted as asyncio.Timeout
    counts it.
    """

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline  # loop.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task[Any] | None = None
        self._cancelling = 0  # the waiter's cancel requests before this wait
        self._expired = False
        self._cancelled_waiter = False

    async def wait(self, waiting: Awaitable[T]) -> T:
        loop = self._loop
        if loop is None:
            self._loop = loop = asyncio.get_running_loop()
            if loop.time() >= self._deadline:
                self._expired = True
            else:
                self._timer = loop.call_at(self._deadline, self._expire)
        if self._expired:
            waiting.close()  # type: ignore[attr-defined]  # a coroutine or anext()'s awaitable: both close
            raise LifetimeExceededError("The request ran past its lifetime cap")
        task = asyncio.current_task(loop)
        assert task is not None
        self._waiter, self._cancelling = task, task.cancelling()
        try:
            got = await waiting
        except asyncio.CancelledError:
            if self._cancelled_waiter and task.uncancel() <= self._cancelling:
                raise LifetimeExceededError("The request ran past its lifetime cap") from None
            raise
        finally:
            self._waiter = None
        if self._cancelled_waiter:  # what it awaited swallowed our cancel: take it back; the next wait raises
            task.uncancel()
        return got

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._waiter is not None:
            self._cancelled_waiter = True
            self._waiter.cancel()


class Fanout:
    def __init__(self, driver: Driver, requests: list[GenerationRequest], deadline: float) -> None:
        self._driver = driver
        self._requests = requests
        self._deadline = deadline  # loop.time() after which the generation is cut
        self._iters: list[AsyncIterator[GenerationChunk]] = []
        self._firsts: list[GenerationChunk | None] = []
        self._finished: set[int] = set()
        self._pumps: list[asyncio.Task[None]] = []
        self._lifetime = _Lifetime(deadline)
        self._closed = False

    async def open(self) -> None:
        """Start every stream and wait for its first chunk; on any error close all and re-raise."""
        self._iters = [self._driver.generate(r) for r in self._requests]
        firsts = [asyncio.ensure_future(anext(it, None)) for it in self._iters]
        try:
            async with asyncio.timeout_at(self._deadline):
                done, _ = await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
                failed = [t for t in done if not t.cancelled() and t.exception() is not None]
                if failed:
                    raise cast(BaseException, failed[0].exception())
                await asyncio.gather(*firsts)
        except TimeoutError:
            await self._abandon(firsts)
            raise LifetimeExceededError("The request timed out before the first token") from None
        except BaseException:
            await self._abandon(firsts)
            raise
        self._firsts = [t.result() for t in firsts]

    async def chunks(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """Every chunk of every stream, in arrival order, first chunks first."""
        for i, first in enumerate(self._firsts):
            if first is None or first.finish_reason is not None:
                self._finished.add(i)
            if first is not None:
                yield i, first
        pending = [i for i in range(len(self._iters)) if i not in self._finished]
        if len(pending) == 1:  # common case n=1: no pump task, no queue
            i = pending[0]
            # anext(it, None): the chunk or None at the end, with no coroutine frame of ours around it.
            while (chunk := await self._lifetime.wait(anext(self._iters[i], None))) is not None:
                if chunk.finish_reason is not None:
                    self._finished.add(i)
                yield i, chunk
            self._finished.add(i)
            return
        queue: asyncio.Queue[tuple[int, GenerationChunk | Exception | None]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, queue)) for i in pending]
        remaining = len(pending)
        while remaining:
            i, item = await self._lifetime.wait(queue.get())
            if item is _END:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            assert item is not None
            if item.finish_reason is not None:
                self._finished.add(i)
            yield i, item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lifetime.close()
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(BaseException):
                await task
        for i, it in enumerate(self._iters):
            closer = getattr(it, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            if i not in self._finished:  # closing aborts per the contract; say it explicitly too
                with contextlib.suppress(Exception):
                    await self._driver.abort(self._requests[i].request_id)

    async def _pump(
        self, i: int, queue: asyncio.Queue[tuple[int, GenerationChunk | Exception | None]]
    ) -> None:
        try:
            async for chunk in self._iters[i]:
                await queue.put((i, chunk))
        except Exception as exc:  # noqa: BLE001 - not swallowed: the consumer re-raises it in its task
            await queue.put((i, exc))
        await queue.put((i, _END))

    async def _abandon(self, firsts: Sequence[asyncio.Future[GenerationChunk | None]]) -> None:
        for task in firsts:
            task.cancel()
        for task in firsts:
            with contextlib.suppress(BaseException):
                await task
        await self.aclose()

