"""Usage records off the request path: a bounded queue drained in batches by one background task.

The request path only calls `UsageWriter.record()` (no I/O, never blocks). The
writer inserts a batch every `batch_size` rows or `flush_interval_s`, whichever
comes first, and `close()` drains everything, so a clean shutdown loses nothing.
A full queue (the database is far behind) drops the record and logs it: usage
must never stall inference.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from dataclasses import asdict, dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.models import utcnow
from tenants.repository import ApiKeyRepository, UsageRepository
from tenants.service import month_start

log = logging.getLogger("sluice.tenants")


@dataclass(frozen=True)
class UsageEvent:
    request_id: str
    tenant_id: str
    key_id: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    latency_ms: float
    status: str  # "ok", "disconnected", "timeout", "rate_limited", an error class name, ...
    created_at: dt.datetime = field(default_factory=utcnow)


class UsageWriter:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        batch_size: int = 500,
        flush_interval_s: float = 0.25,
        max_queue: int = 100_000,
    ) -> None:
        self.sessions = sessions
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self._queue: asyncio.Queue[UsageEvent] = asyncio.Queue(max_queue)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._wake = asyncio.Event()
        self.dropped = 0
        self.written = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    def record(self, event: UsageEvent) -> None:
        try:
            self._queue.put_nowait(event)
            if self._queue.qsize() >= self.batch_size:
                self._wake.set()
        except asyncio.QueueFull:
            self.dropped += 1
            log.error("usage queue full, record dropped", extra={"request_id": event.request_id})

    async def close(self) -> None:
        """Write everything queued so far, then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self._write(self._drain(self.batch_size * 1000))  # records that raced the writer's exit

    async def _run(self) -> None:
        while not (self._closing and self._queue.empty()):
            if self._queue.qsize() < self.batch_size and not self._closing:
                # Sleep one interval unless a full batch or close() wakes us earlier.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            await self._write(self._drain(self.batch_size))

    def _drain(self, limit: int) -> list[UsageEvent]:
        out: list[UsageEvent] = []
        while len(out) < limit:
            try:
                out.append(self._queue.get_nowait())
            except asyncio.QueueEmpty:
                break
        return out

    async def _write(self, batch: list[UsageEvent]) -> None:
        if not batch:
            return
        last_used: dict[str, dt.datetime] = {}
        for event in batch:
            if event.key_id and (event.key_id not in last_used or last_used[event.key_id] < event.created_at):
                last_used[event.key_id] = event.created_at
        for attempt in range(3):
            try:
                async with self.sessions.begin() as session:
                    await UsageRepository(session).add_many([asdict(e) for e in batch])
                    await ApiKeyRepository(session).touch(last_used)
                self.written += len(batch)
                return
            except Exception:  # the DB is down or locked: retry, then give up on this batch loudly
                log.exception("usage write failed", extra={"rows": len(batch), "attempt": attempt + 1})
                await asyncio.sleep(0.2 * (attempt + 1))
        self.dropped += len(batch)


class MonthlyUsage:
    """Tokens a tenant used this calendar month (UTC), for the monthly budget check.

    The database total is re-read at most every `refresh_s` per tenant; tokens this
    replica recorded since are added locally, so one replica never overshoots by more than
    its in-flight requests, and replicas see each other within refresh_s + a flush."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], refresh_s: float = 2.0) -> None:
        self.sessions = sessions
        self.refresh_s = refresh_s
        self._totals: dict[str, tuple[float, dt.datetime, int]] = {}  # tenant -> (read at, month, tokens)

    async def used(self, tenant_id: str) -> int:
        now = utcnow()
        month = month_start(now)
        cached = self._totals.get(tenant_id)
        if cached is not None and cached[1] == month and time.monotonic() - cached[0] < self.refresh_s:
            return cached[2]
        async with self.sessions() as session:
            total = await UsageRepository(session).tokens_since(tenant_id, month)
        self._totals[tenant_id] = (time.monotonic(), month, total)
        return total

    def add(self, tenant_id: str, tokens: int) -> None:
        cached = self._totals.get(tenant_id)
        if cached is not None:
            self._totals[tenant_id] = (cached[0], cached[1], cached[2] + tokens)
