"""Who is in the fleet: a view of `WorkerInfo` by worker id, kept fresh by one of two sources.

Redis (workers register themselves; gateways watch):

    sluice:fleet:incarnation:<id>   INCR on every worker start: its incarnation number
    sluice:fleet:worker:<id>        the WorkerInfo (JSON), SET with a TTL on every heartbeat
    sluice:fleet:events             pub/sub: "<id>" when a worker joins, changes state or leaves

A heartbeat only writes when no newer incarnation of the same id exists (one Lua script), so a
zombie (a paused process that wakes after its replacement started) cannot overwrite its successor;
it learns it is fenced and stops heartbeating. A worker that misses heartbeats vanishes with the
TTL; gateways rescan every `rescan_s` and at once on an event, so it is out of every view within
TTL + rescan. Gateways never write: two of them read the same view.

Static (`--workers URL,...`, no Redis): the gateway polls each URL's GET /fleet/v1/info every
`rescan_s`; a worker that has not answered for the TTL leaves the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from drivers.fleet import wire
from drivers.fleet.wire import WorkerInfo

log = logging.getLogger("sluice.fleet")

PREFIX = "sluice:fleet:"
CHANNEL = PREFIX + "events"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def incarnation_key(worker_id: str) -> str:
    return f"{PREFIX}incarnation:{worker_id}"


# KEYS: record, incarnation counter. ARGV: record JSON, my incarnation, TTL ms. 1: written, 0: fenced.
_HEARTBEAT = """
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
if newest > tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
# KEYS: record, incarnation counter. ARGV: my incarnation. Deletes only my own record.
_LEAVE = """
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
if newest > tonumber(ARGV[1]) then return 0 end
return redis.call('DEL', KEYS[1])
"""


class WorkerRegistration:
    """The worker's side: register (take an incarnation), heartbeat its info, leave."""

    def __init__(
        self, redis_url: str, worker_id: str, info: Callable[[], Awaitable[WorkerInfo]],
        interval_s: float, ttl_s: float,
    ) -> None:
        self.redis = aioredis.from_url(redis_url)
        self.worker_id = worker_id
        self.info = info
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self.incarnation = 0
        self.fenced = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def register(self) -> int:
        self.incarnation = int(await self.redis.incr(incarnation_key(self.worker_id)))
        return self.incarnation

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sluice-heartbeat")

    def changed(self) -> None:
        """State changed: heartbeat now, not at the next tick (drain must be seen within 1 s)."""
        self._wake.set()

    async def beat(self) -> str | None:
        """Write the record; returns the state written, None when fenced."""
        info = await self.info()
        keys = [worker_key(self.worker_id), incarnation_key(self.worker_id)]
        record = msgspec.json.encode(info)
        written = await self.redis.eval(_HEARTBEAT, 2, *keys, record, self.incarnation, self.ttl_ms)  # type: ignore[misc]
        if not written:
            self.fenced = True
            log.error("fenced: a newer incarnation of %s registered; heartbeats stop", self.worker_id)
            return None
        return str(info.state)

    async def _run(self) -> None:
        last_state: str | None = None
        while not self.fenced:
            try:
                state = await self.beat()
                if state is not None and state != last_state:
                    await self.redis.publish(CHANNEL, self.worker_id)
                    last_state = state
            except (RedisError, OSError) as exc:  # Redis away: keep trying; the TTL takes us out meanwhile
                log.warning("heartbeat failed: %s", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def leave(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError, OSError):
            keys = [worker_key(self.worker_id), incarnation_key(self.worker_id)]
            await self.redis.eval(_LEAVE, 2, *keys, self.incarnation)  # type: ignore[misc]
            await self.redis.publish(CHANNEL, self.worker_id)
        await self.redis.aclose()


class Membership(ABC):
    """The gateway's side: the current view, refreshed in the background."""

    def __init__(self, rescan_s: float) -> None:
        self.rescan_s = rescan_s
        self.view: dict[str, WorkerInfo] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="sluice-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @abstractmethod
    async def refresh(self) -> None:
        """Rebuild `view` from the source."""

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.rescan_s)
            try:
                await self.refresh()
            except (RedisError, OSError) as exc:  # the source is away: keep the last view, the TTLs still apply
                log.warning("membership refresh failed: %s", exc)
                self._expire()

    def _expire(self) -> None:
        """Without a fresh view, drop what is older than the TTL by the worker's own clock."""


class RedisMembership(Membership):
    def __init__(self, redis_url: str, rescan_s: float, ttl_s: float) -> None:
        super().__init__(rescan_s)
        self.redis = aioredis.from_url(redis_url)
        self.ttl_s = ttl_s
        self._listener: asyncio.Task[None] | None = None
        self._decoder = msgspec.json.Decoder(WorkerInfo)

    async def start(self) -> None:
        await super().start()
        self._listener = asyncio.create_task(self._listen(), name="sluice-membership-events")

    async def stop(self) -> None:
        await super().stop()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        await self.redis.aclose()

    async def refresh(self) -> None:
        keys = [k async for k in self.redis.scan_iter(match=worker_key("*"), count=500)]
        values = await self.redis.mget(keys) if keys else []
        view = {}
        for raw in values:
            if raw is None:
                continue  # expired between SCAN and MGET
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                info = self._decoder.decode(raw)
                view[info.id] = info
        self.view = view

    def _expire(self) -> None:
        now = time.time()
        self.view = {k: v for k, v in self.view.items() if now - v.heartbeat_at <= self.ttl_s}

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("membership events lost (%s); rescans continue", exc)
                await asyncio.sleep(self.rescan_s)


class StaticMembership(Membership):
    def __init__(self, urls: list[str], rescan_s: float, ttl_s: float, secret: str | None) -> None:
        super().__init__(rescan_s)
        self.urls = [u.rstrip("/") for u in urls]
        self.ttl_s = ttl_s
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(min(1.0, ttl_s)))
        self._last_ok: dict[str, float] = {}
        self._by_url: dict[str, WorkerInfo] = {}

    async def stop(self) -> None:
        await super().stop()
        await self._client.aclose()

    async def refresh(self) -> None:
        await asyncio.gather(*(self._poll(url) for url in self.urls))
        now = time.monotonic()
        self.view = {
            info.id: info for url, info in self._by_url.items() if now - self._last_ok.get(url, 0.0) <= self.ttl_s
        }

    async def _poll(self, url: str) -> None:
        try:
            response = await self._client.get(url + wire.INFO_PATH)
            response.raise_for_status()
            info = wire.INFO_DECODER.decode(response.content)
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
            return
        # The URL we were given is how we reach it, whatever it advertises.
        self._by_url[url] = msgspec.structs.replace(info, address=url)
        self._last_ok[url] = time.monotonic()
