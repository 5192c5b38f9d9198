"""Helpers for the rate-limit tests: the two backends behind one factory, a private redis-server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from ratelimit.base import RateLimiter, TenantLimits
from ratelimit.memory import InProcessRateLimiter
from ratelimit.redis_backend import RedisRateLimiter

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


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
        """Another replica (Redis), or the same limiter again (in-process: nothing else shares its state)."""
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


def admit_many_in_process(prefix: str, request_prefix: str, count: int, start_at: float) -> int:
    """Run in a spawned process: `count` concurrent admits on rpm=10 at wall time `start_at`; allowed count."""

    async def main() -> int:
        limiter = RedisRateLimiter(REDIS_URL, key_prefix=prefix)
        limits = TenantLimits(requests_per_minute=10)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        results = await asyncio.gather(
            *(limiter.admit("t", f"{request_prefix}-{i}", limits, 1) for i in range(count))
        )
        await limiter.close()
        return sum(a.allowed for a in results)

    return asyncio.run(main())


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
        deadline = time.monotonic() + 10
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
