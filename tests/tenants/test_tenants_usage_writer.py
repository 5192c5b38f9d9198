"""The usage writer keeps every row it can, on SQLite and PostgreSQL: client strings of any length
and content are stored bounded, a row the database refuses costs only itself, and rows recorded
while the database is unreachable are written once it is back."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from tenants.db import async_url, create_engine, run_migrations, session_factory
from tenants.models import ApiKey, UsageRecord
from tenants.service import TenantService, TenantSpec
from tenants.usage import UsageEvent, UsageWriter, UsageWriterConfig

Sessions = async_sessionmaker[AsyncSession]
HANG_S = 120.0  # deadlines only catch hangs: a loaded 2-core machine may be slow, never this slow
# Retries come quickly in tests; the backoff shape is the same as in production.
QUICK = UsageWriterConfig(batch_size=10_000, flush_interval_s=60.0, retry_initial_s=0.05, retry_max_s=0.2)


def run(url: str, scenario: Callable[[AsyncEngine, Sessions], Awaitable[None]], **engine: Any) -> None:
    async def main() -> None:
        db = create_engine(url, **engine)
        await run_migrations(db)
        try:
            await scenario(db, session_factory(db))
        finally:
            await db.dispose()

    asyncio.run(main())


def event(tenant_id: str, i: int, key_id: str | None = None, **fields: Any) -> UsageEvent:
    values: dict[str, Any] = {
        "request_id": f"req-{i}",
        "tenant_id": tenant_id,
        "key_id": key_id,
        "model": "m",
        "prompt_tokens": 3,
        "completion_tokens": i,
        "ttft_ms": 1.0,
        "latency_ms": 2.0,
        "status": "ok",
        **fields,
    }
    return UsageEvent(**values)


async def rows_of(sessions: Sessions, tenant_id: str) -> list[UsageRecord]:
    async with sessions() as session:
        query = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id).order_by(UsageRecord.id)
        return list((await session.execute(query)).scalars().all())


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        await asyncio.sleep(0.02)


def test_client_strings_of_any_length_or_content_are_stored_bounded(fresh_db_url: str) -> None:
    """Before: a 10,000-character model (or a NUL byte) failed the whole batch on PostgreSQL and
    every tenant's rows in it were dropped; SQLite kept it unbounded; a lone surrogate or NaN
    failed the batch on both."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        good, bad = str(uuid.uuid4()), str(uuid.uuid4())
        writer = UsageWriter(sessions, QUICK)
        writer.start()
        for i in range(100):
            writer.record(event(good, i))
        hostile: list[dict[str, Any]] = [
            {"model": "x" * 10_000},
            {"model": "gpt\x00nul"},
            {"model": "lone \ud800 surrogate"},
            {"request_id": "r" * 5_000, "status": "S" * 5_000},
            {"prompt_tokens": 2**40, "completion_tokens": -5},
            {"latency_ms": float("nan"), "ttft_ms": float("inf")},
            {"created_at": dt.datetime(2030, 1, 1)},  # naive: read as UTC
        ]
        for i, fields in enumerate(hostile):
            writer.record(event(bad, i, **fields))
        for i in range(100, 200):
            writer.record(event(good, i))
        await writer.close()

        assert (writer.written, writer.dropped) == (207, 0)
        assert [r.completion_tokens for r in await rows_of(sessions, good)] == list(range(200))
        stored = await rows_of(sessions, bad)
        assert len(stored) == len(hostile)
        assert [len(r.model) for r in stored][:3] == [200, len("gpt\x00nul"), len("lone \ud800 surrogate")]
        assert stored[1].model == "gpt\ufffdnul" and stored[2].model == "lone \ufffd surrogate"
        assert (len(stored[3].request_id), len(stored[3].status)) == (80, 40)
        assert (stored[4].prompt_tokens, stored[4].completion_tokens) == (2**31 - 1, 0)
        assert (stored[5].latency_ms, stored[5].ttft_ms) == (0.0, None)
        assert stored[6].created_at == dt.datetime(2030, 1, 1, tzinfo=dt.UTC)

    run(fresh_db_url, scenario)


def _refuse_model(engine: AsyncEngine, model: str) -> str:
    """DDL making the database itself refuse usage rows of `model`: a row no validation anticipates."""
    if engine.dialect.name == "postgresql":
        return f"ALTER TABLE usage_records ADD CONSTRAINT refuse_model CHECK (model <> '{model}')"
    return (
        "CREATE TRIGGER refuse_model BEFORE INSERT ON usage_records "
        f"WHEN NEW.model = '{model}' BEGIN SELECT RAISE(ABORT, 'refused model'); END"
    )


def test_a_row_the_database_refuses_costs_only_itself(
    fresh_db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: one refused row failed its batch three times and the batch (up to 500 rows of all
    tenants) was dropped."""

    async def scenario(engine: AsyncEngine, sessions: Sessions) -> None:
        async with engine.begin() as conn:
            await conn.execute(text(_refuse_model(engine, "poison")))
        service = TenantService(sessions)
        tenant = await service.create_tenant(TenantSpec(name=f"t-{uuid.uuid4().hex[:8]}"))
        key, _ = await service.create_key(tenant.id, "k")
        writer = UsageWriter(sessions, QUICK)
        writer.start()
        poisoned = {37, 38, 301}  # neighbours and a loner, in one batch of 400
        for i in range(400):
            writer.record(event(tenant.id, i, key.id, model="poison" if i in poisoned else "m"))
        with caplog.at_level(logging.ERROR, logger="sluice.tenants"):
            await writer.close()

        stored = await rows_of(sessions, tenant.id)
        assert [r.completion_tokens for r in stored] == [i for i in range(400) if i not in poisoned]
        assert (writer.written, writer.rejected, writer.failed_writes) == (397, 3, 0)
        refused = [r for r in caplog.records if r.getMessage().startswith("usage record refused")]
        assert sorted(r.__dict__["request_id"] for r in refused) == sorted(f"req-{i}" for i in poisoned)
        assert all(r.__dict__["tenant_id"] == tenant.id for r in refused)
        async with sessions() as session:
            touched = await session.get(ApiKey, key.id)
        assert touched is not None and touched.last_used_at is not None

    run(fresh_db_url, scenario)


# -- outages ---------------------------------------------------------------------------------------


class Outage:
    """Takes the test's database away and brings it back, the way it happens in production: for
    PostgreSQL the server refuses connections to it and drops the open ones; for SQLite another
    process holds the file's write lock longer than a writer waits (busy timeout)."""

    def __init__(self, url: str) -> None:
        self.url = make_url(async_url(url))
        self._holder: sqlite3.Connection | None = None

    async def begin(self) -> None:
        if self.url.get_backend_name() == "sqlite":
            self._holder = sqlite3.connect(str(self.url.database), isolation_level=None)
            self._holder.execute("BEGIN EXCLUSIVE")
            return
        await self._on_server(f"ALTER DATABASE {self.url.database} WITH ALLOW_CONNECTIONS false")
        await self._on_server(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{self.url.database}' AND pid <> pg_backend_pid()"
        )

    async def end(self) -> None:
        if self._holder is not None:
            self._holder.execute("ROLLBACK")
            self._holder.close()
            self._holder = None
            return
        await self._on_server(f"ALTER DATABASE {self.url.database} WITH ALLOW_CONNECTIONS true")

    async def _on_server(self, statement: str) -> None:
        server = create_async_engine(self.url.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            async with server.connect() as conn:
                await conn.execute(text(statement))
        finally:
            await server.dispose()


def test_usage_recorded_while_the_database_is_away_is_written_when_it_is_back(fresh_db_url: str) -> None:
    """Before: three quick retries, then the batch was dropped."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        tenant = str(uuid.uuid4())
        config = UsageWriterConfig(flush_interval_s=0.02, retry_initial_s=0.05, retry_max_s=0.2)
        writer = UsageWriter(sessions, config)
        writer.start()
        for i in range(5):
            writer.record(event(tenant, i))
        await until(lambda: writer.written == 5, "the first rows")

        outage = Outage(fresh_db_url)
        await outage.begin()
        try:
            for i in range(5, 25):
                writer.record(event(tenant, i))
            await until(lambda: writer.failed_writes >= 3, "writes to fail")
            assert (writer.buffered, writer.dropped) == (20, 0)
        finally:
            await outage.end()

        await until(lambda: writer.written == 25, "the buffered rows to be written")
        await writer.close()
        assert [r.completion_tokens for r in await rows_of(sessions, tenant)] == list(range(25))
        assert writer.dropped == 0

    run(fresh_db_url, scenario, sqlite_busy_timeout_s=0.1)


def test_a_full_buffer_counts_what_it_could_not_keep(fresh_db_url: str) -> None:
    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        tenant = str(uuid.uuid4())
        config = UsageWriterConfig(
            flush_interval_s=0.02, max_buffered=10, retry_initial_s=0.05, retry_max_s=0.2, close_timeout_s=0.5
        )
        writer = UsageWriter(sessions, config)
        writer.start()
        outage = Outage(fresh_db_url)
        await outage.begin()
        try:
            for i in range(15):
                writer.record(event(tenant, i))
            assert (writer.buffered, writer.overflowed) == (10, 5)
            await until(lambda: writer.failed_writes >= 1, "a write to fail")
        finally:
            await outage.end()
        await until(lambda: writer.written == 10, "the kept rows to be written")

        # Down again at shutdown: close() gives up after its deadline and counts what it could not write.
        await outage.begin()
        try:
            writer.record(event(tenant, 99))
            await writer.close()
        finally:
            await outage.end()
        assert (writer.written, writer.overflowed, writer.lost, writer.dropped) == (10, 5, 1, 6)
        assert [r.completion_tokens for r in await rows_of(sessions, tenant)] == list(range(10))

    run(fresh_db_url, scenario, sqlite_busy_timeout_s=0.1)
