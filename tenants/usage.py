"""Usage records off the request path, and the monthly total the budget check reads.

The request path only calls `UsageWriter.record()` (no I/O, never blocks). Rows wait in one
bounded in-memory buffer; a background task writes them in batches every `batch_size` rows or
`flush_interval_s`, whichever comes first, and `close()` drains the buffer on shutdown.

What happens to a row that is not written at once:

    a value the column cannot hold    fitted first (`fitted`: text cut to the column and
                                      cleaned of NUL/unpaired surrogates, numbers clamped), so
                                      client input cannot make a row unwritable
    a row the database still refuses  isolated by bisecting its batch: the other rows are
                                      written, the refused one is logged and counted (`rejected`)
    the database is down or locked    every row stays buffered; writes are retried with
                                      exponential backoff and the buffer flushes on recovery
    the buffer is full                the new row is logged and counted (`overflowed`)
    still buffered after close()'s    logged and counted (`lost`)
    deadline

Usage must never stall inference, hence a bounded buffer instead of back-pressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.bounds import USAGE_TEXT_CHARS, clamp_int, finite_or_none, storable_text, utc
from tenants.models import utcnow
from tenants.repository import ApiKeyRepository, UsageRepository
from tenants.service import month_start

log = logging.getLogger("sluice.tenants")


@dataclass(frozen=True, slots=True)
class UsageEvent:
    request_id: str
    tenant_id: str
    key_id: str | None
    model: str  # as the client sent it: any length, any characters
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    latency_ms: float
    status: str  # "ok", "disconnected", "timeout", "rate_limited", an error class name, ...
    created_at: dt.datetime = field(default_factory=utcnow)


def fitted(event: UsageEvent) -> UsageEvent:
    """`event` with every value fitted to its `usage_records` column (see tenants/bounds.py). Done when
    a record arrives, so the buffer never holds more than a row's worth of what a client sent."""
    text = {
        name: storable_text(getattr(event, name) or "", chars) for name, chars in USAGE_TEXT_CHARS.items()
    }
    try:
        created_at = utc(event.created_at)
    except OverflowError:
        created_at = utcnow()
    return UsageEvent(
        request_id=text["request_id"],
        tenant_id=text["tenant_id"],
        key_id=text["key_id"] if event.key_id is not None else None,
        model=text["model"],
        prompt_tokens=clamp_int(event.prompt_tokens),
        completion_tokens=clamp_int(event.completion_tokens),
        ttft_ms=finite_or_none(event.ttft_ms),
        latency_ms=finite_or_none(event.latency_ms) or 0.0,
        status=text["status"],
        created_at=created_at,
    )


def usage_row(event: UsageEvent) -> dict[str, Any]:
    """The `usage_records` row of a fitted event."""
    return {name: getattr(event, name) for name in UsageEvent.__dataclass_fields__}


def is_row_fault(exc: BaseException) -> bool:
    """Whether the database refused these rows for their values (bisect to find the bad one), rather
    than failing for every row alike (down, locked, misconfigured: keep them all and retry)."""
    for cause in _causes(exc):
        if isinstance(cause, IntegrityError | DataError):
            return True
        if isinstance(cause, DBAPIError):
            # SQLSTATE class 22 is "data exception", 23 "integrity constraint violation".
            state = getattr(cause.orig, "sqlstate", None) or getattr(cause.orig, "pgcode", None)
            if isinstance(state, str) and state[:2] in ("22", "23"):
                return True
            continue  # the DBAPI error itself may wrap the driver's ValueError below
        if isinstance(cause, StatementError | ValueError | TypeError | OverflowError):
            return True  # a bind parameter the driver could not encode (UnicodeEncodeError is a ValueError)
    return False


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = current.orig if isinstance(current, StatementError) else None
        current = orig if isinstance(orig, BaseException) else current.__cause__


class UsageOutbox(Protocol):
    """Something written in the same transaction as each batch of usage records (the billing outbox,
    billing/ledger.py). A row fault it raises is the batch's: the batch is bisected as for any other."""

    async def add(self, session: AsyncSession, batch: Sequence[UsageEvent]) -> None: ...


class DatabaseUnavailableError(Exception):
    """A write failed for a reason that is not the rows': the rows stay buffered."""


@dataclass(frozen=True)
class UsageWriterConfig:
    batch_size: int = 500
    """Rows per INSERT; a full batch is written without waiting for the interval."""
    flush_interval_s: float = 0.25
    """Longest a row waits before it is written (the gateway's SLUICE_USAGE_FLUSH_MS / 1000)."""
    max_buffered: int = 100_000
    """Rows held in memory while the database is behind or down (under 100 MB); a row that
    arrives when it is full is dropped and counted as overflowed."""
    retry_initial_s: float = 0.25
    """First wait after a failed write; it doubles with every failure in a row."""
    retry_max_s: float = 15.0
    """Longest wait between two attempts while the database stays down."""
    close_timeout_s: float = 10.0
    """How long close() keeps trying to write what is buffered before counting it as lost."""


class UsageWriter:
    """Counters (monotonic, for metrics): `written`, `rejected`, `overflowed`, `lost`, plus
    `failed_writes` (attempts that found the database unavailable); `buffered` is a gauge."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        config: UsageWriterConfig | None = None,
        outbox: UsageOutbox | None = None,
    ) -> None:
        self.sessions = sessions
        self.config = config or UsageWriterConfig()
        self.outbox = outbox
        self._rows: deque[UsageEvent] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._wake = asyncio.Event()
        self._retry_in_s = 0.0  # > 0 while the database is failing
        self.written = 0
        self.rejected = 0
        self.overflowed = 0
        self.lost = 0
        self.failed_writes = 0

    @property
    def buffered(self) -> int:
        return len(self._rows)

    @property
    def dropped(self) -> int:
        """Rows that will never be written, for any reason."""
        return self.rejected + self.overflowed + self.lost

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    def record(self, event: UsageEvent) -> None:
        if len(self._rows) >= self.config.max_buffered:
            self.overflowed += 1
            # One line per record, as for every request anyway: enough to bill it by hand.
            log.error(
                "usage buffer full, record dropped",
                extra={
                    "request_id": str(event.request_id)[:100],
                    "tenant_id": str(event.tenant_id)[:100],
                    "prompt_tokens": event.prompt_tokens,
                    "completion_tokens": event.completion_tokens,
                    "buffered": len(self._rows),
                },
            )
            return
        try:
            row = fitted(event)
        except Exception:  # a malformed event (a bug upstream) must not fail the request recording it
            self.rejected += 1
            log.exception("usage record malformed, dropped", extra={"event": repr(event)[:500]})
            return
        self._rows.append(row)
        # While the database is failing the retry schedule decides, not the arrival of rows.
        if len(self._rows) >= self.config.batch_size and not self._retry_in_s:
            self._wake.set()

    async def close(self) -> None:
        """Write everything buffered (retrying for at most `close_timeout_s`), then stop."""
        self._closing = True
        self._wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.close_timeout_s
        while True:
            if self._task is None:
                self._task = asyncio.create_task(self._run(), name="usage-writer")
            try:
                await asyncio.wait_for(self._task, max(0.0, deadline - loop.time()))
            except TimeoutError:
                break  # wait_for cancelled the writer; whatever is still buffered is lost
            finally:
                self._task = None
            if not self._rows:  # else rows were recorded between the writer's exit and now
                break
        if self._rows:
            self.lost += len(self._rows)
            log.error(
                "usage records lost at shutdown: the database stayed unavailable",
                extra={"rows": len(self._rows)},
            )
            self._rows.clear()

    async def _run(self) -> None:
        while not (self._closing and not self._rows):
            if self._retry_in_s:
                # Closing: keep trying, but often enough to use close()'s deadline.
                delay = min(self._retry_in_s, 1.0) if self._closing else self._retry_in_s
            elif self._closing or len(self._rows) >= self.config.batch_size:
                delay = 0.0
            else:
                delay = self.config.flush_interval_s
            if delay:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
            await self._flush()

    async def _flush(self) -> None:
        """Write the buffer in batches until it is empty or the database fails."""
        try:
            while self._rows:
                await self._settle(list(islice(self._rows, self.config.batch_size)))
        except DatabaseUnavailableError as exc:
            self.failed_writes += 1
            if not self._retry_in_s:
                log.error(
                    "usage writes failing, keeping rows",
                    extra={"buffered": len(self._rows)},
                    exc_info=exc.__cause__,
                )
            self._retry_in_s = min(
                max(2 * self._retry_in_s, self.config.retry_initial_s), self.config.retry_max_s
            )
            return
        if self._retry_in_s:
            log.warning("usage writes recovered", extra={"failed_writes": self.failed_writes})
            self._retry_in_s = 0.0

    async def _settle(self, batch: list[UsageEvent]) -> None:
        """Write `batch` (the oldest rows of the buffer) and take it off the buffer, isolating any row
        the database refuses by bisection. Rows settle oldest first, so the settled ones are always
        at the buffer's head. DatabaseUnavailableError leaves the unsettled rows where they are."""
        try:
            await self._insert(batch)
        except Exception as exc:
            if not is_row_fault(exc):
                raise DatabaseUnavailableError(str(exc)) from exc
            if len(batch) == 1:
                self._reject(batch[0], exc)
                return
            middle = len(batch) // 2
            await self._settle(batch[:middle])
            await self._settle(batch[middle:])
            return
        for event in batch:
            assert self._rows[0] is event, "usage rows settle oldest first"
            self._rows.popleft()
        self.written += len(batch)

    async def _insert(self, batch: list[UsageEvent]) -> None:
        last_used: dict[str, dt.datetime] = {}
        for event in batch:
            if event.key_id and (event.key_id not in last_used or last_used[event.key_id] < event.created_at):
                last_used[event.key_id] = event.created_at
        async with self.sessions.begin() as session:
            await UsageRepository(session).add_many([usage_row(e) for e in batch])
            await ApiKeyRepository(session).touch(last_used)
            if self.outbox is not None:
                await self.outbox.add(session, batch)

    def _reject(self, event: UsageEvent, exc: Exception) -> None:
        assert self._rows[0] is event, "usage rows settle oldest first"
        self._rows.popleft()
        self.rejected += 1
        # Enough to bill the request by hand (every value is already fitted to its column).
        log.error(
            "usage record refused by the database, dropped",
            extra={
                "request_id": event.request_id,
                "tenant_id": event.tenant_id,
                "key_id": event.key_id,
                "model": event.model,
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
                "status": event.status,
                "created_at": str(event.created_at),
                "error": str(exc)[:500],
            },
        )


class MonthlyUsage:
    """Tokens a tenant used this calendar month (UTC), for the monthly budget check.

    The database total is re-read at most every `refresh_s` per tenant, by one query however many
    requests ask at once (they await the same read); tokens this replica recorded since are added
    locally, so one replica never overshoots by more than its in-flight requests, and replicas see
    each other within refresh_s + a flush. If a re-read fails, the last total is used until one
    succeeds (the budget check is not worth refusing requests over while the database is down)."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        refresh_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.refresh_s = refresh_s
        self.clock = clock
        self._totals: dict[str, tuple[float, dt.datetime, int]] = {}  # tenant -> (read at, month, tokens)
        self._reading: dict[str, asyncio.Task[int]] = {}

    async def used(self, tenant_id: str) -> int:
        month = month_start(utcnow())
        cached = self._totals.get(tenant_id)
        if cached is not None and cached[1] == month and self.clock() - cached[0] < self.refresh_s:
            return cached[2]
        reading = self._reading.get(tenant_id)
        if reading is None:
            reading = self._start_read(tenant_id, month)
        try:
            # Shielded: one caller giving up (client gone) must not cancel the read for the others.
            return await asyncio.shield(reading)
        except Exception:
            if cached is not None and cached[1] == month:
                return cached[2]
            raise

    def _start_read(self, tenant_id: str, month: dt.datetime) -> asyncio.Task[int]:
        reading = asyncio.create_task(self._read(tenant_id, month), name="monthly-usage-read")
        self._reading[tenant_id] = reading

        def done(task: asyncio.Task[int]) -> None:
            if self._reading.get(tenant_id) is task:
                del self._reading[tenant_id]
            if not task.cancelled():
                task.exception()  # retrieved here: every waiter re-raises it, nobody else must

        reading.add_done_callback(done)
        return reading

    async def _read(self, tenant_id: str, month: dt.datetime) -> int:
        try:
            async with self.sessions() as session:
                total = await UsageRepository(session).tokens_since(tenant_id, month)
        except Exception:
            log.exception("monthly usage read failed", extra={"tenant_id": tenant_id})
            raise
        self._totals[tenant_id] = (self.clock(), month, total)
        return total

    def add(self, tenant_id: str, tokens: int) -> None:
        cached = self._totals.get(tenant_id)
        if cached is not None:
            self._totals[tenant_id] = (cached[0], cached[1], cached[2] + tokens)
