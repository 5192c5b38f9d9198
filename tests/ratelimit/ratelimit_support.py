"""Helpers for the rate-limit tests: the two backends behind one factory, a clock moved by hand,
a private redis-server, a TCP proxy that holds Redis' traffic back, and a poll that only catches hangs."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from typing import Any

import redis

from ratelimit.base import RateLimiter, TenantLimits
from ratelimit.memory import InProcessRateLimiter
from ratelimit.redis_backend import RedisRateLimiter

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# Only catches hangs: on a loaded machine things take long, never this long.
HANG_S = 60.0


class StepClock:
    """A clock the test moves by hand (seconds), so a minute of refill takes no time and nothing
    refills or expires behind the test's back."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]], what: str, within_s: float = HANG_S
) -> None:
    """Poll `check` until it holds; fail saying `what` did not happen once `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {within_s:.0f} s")
        await asyncio.sleep(0.02)


def unique_prefix() -> str:
    return f"sluice:test:{uuid.uuid4().hex[:12]}:"


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@dataclass
class Backend:
    """Makes limiters that share state: Redis replicas on one prefix, or the one in-process limiter."""

    name: str
    prefix: str = field(default_factory=unique_prefix)
    _made: list[RateLimiter] = field(default_factory=list)

    def make(self, **opts: Any) -> RateLimiter:
        """Another replica (Redis), or the same limiter again (in-process: nothing else shares its state).

        opts: `lease_s`, `clock` (both backends), and Redis-only ones."""
        if self.name == "memory":
            if not self._made:
                self._made.append(InProcessRateLimiter(**opts))
            return self._made[0]
        limiter = RedisRateLimiter(REDIS_URL, key_prefix=self.prefix, **opts)
        self._made.append(limiter)
        return limiter

    async def close(self) -> None:
        for limiter in self._made:
            await limiter.close()
        self._made.clear()


def admit_many_in_process(prefix: str, request_prefix: str, count: int, start: Barrier, out: Any) -> None:
    """Run in a spawned process: `count` concurrent admits on rpm=10 once every process is ready
    (`start`); puts the allowed count on `out`."""

    async def main() -> int:
        limiter = RedisRateLimiter(REDIS_URL, key_prefix=prefix)
        limits = TenantLimits(requests_per_minute=10)
        await limiter.admit("warm-up", request_prefix, TenantLimits(), 1)  # connected before the barrier
        start.wait(HANG_S)
        results = await asyncio.gather(
            *(limiter.admit("t", f"{request_prefix}-{i}", limits, 1) for i in range(count))
        )
        await limiter.close()
        return sum(a.allowed for a in results)

    out.put(asyncio.run(main()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A throwaway redis-server on a fixed port, which a test may kill, pause and start again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not on PATH"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis(free_port())
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.resume()
        server.kill()


class _Link:
    """One client connection through the proxy: its own gates, and whether it has ended."""

    def __init__(self) -> None:
        self.commands = asyncio.Event()
        self.replies = asyncio.Event()
        self.commands.set()
        self.replies.set()
        self.ended = asyncio.Event()


class RedisProxy:
    """A TCP proxy in front of a Redis that can hold its traffic back, as a stalled network does.

    `hold_replies()`: commands still reach Redis and run, their replies wait here (a reply lost
    to the caller's timeout after the script ran). `stall_open_connections()`: what the
    connections open now send or receive waits here, while new connections flow (a command
    stuck on its way that reaches Redis after later ones). `flow()`: everything held is passed
    on, in order, and traffic flows again. A client that leaves is passed on as a half-close once
    what it sent has reached Redis, as the kernel would: Redis runs it, answers, then hangs up.
    Runs in the test's event loop.
    """

    def __init__(self, upstream_port: int = 6379) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.replies_held = 0  # reply chunks that arrived from Redis while replies were held
        self._replies = asyncio.Event()
        self._replies.set()
        self._links: set[_Link] = set()
        self._stalled: list[_Link] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, db: int = 15) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def hold_replies(self) -> None:
        self._replies.clear()

    def stall_open_connections(self) -> None:
        self._stalled = list(self._links)
        for link in self._stalled:
            link.commands.clear()
            link.replies.clear()

    def flow(self) -> None:
        self._replies.set()
        for link in self._links:
            link.commands.set()
            link.replies.set()

    async def stalled_ended(self) -> None:
        """Wait until every stalled connection has ended: what it held has reached Redis and run."""
        for link in self._stalled:
            await asyncio.wait_for(link.ended.wait(), HANG_S)

    async def close(self) -> None:
        self.flow()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        link = _Link()
        try:
            redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        self._links.add(link)
        up = asyncio.create_task(self._pump(client_r, redis_w, (link.commands,)))
        down = asyncio.create_task(self._pump(redis_r, client_w, (self._replies, link.replies)))
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if up.done() and not down.done():
                if redis_w.can_write_eof():
                    redis_w.write_eof()
                await asyncio.wait({down}, timeout=HANG_S)
        finally:
            for pump in (up, down):
                pump.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            client_w.close()
            redis_w.close()
            self._links.discard(link)
            link.ended.set()
            self._tasks.discard(task)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, gates: tuple[asyncio.Event, ...]
    ) -> None:
        while data := await source.read(65536):
            if gates[0] is self._replies and not self._replies.is_set():
                self.replies_held += 1
            while not all(gate.is_set() for gate in gates):
                for gate in gates:
                    await gate.wait()
            try:
                sink.write(data)
                await sink.drain()
            except (ConnectionError, OSError):
                return
