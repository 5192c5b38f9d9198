"""Alembic migrations build an empty database on SQLite and PostgreSQL, and downgrade cleanly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncEngine
from tenant_db import fresh_pg_url

from tenants.db import (
    create_engine,
    create_postgres_database,
    downgrade,
    drop_postgres_database,
    run_migrations,
)

TABLES = {"tenants", "api_keys", "usage_records", "admin_credentials", "alembic_version"}


async def _tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


async def _round_trip(url: str) -> None:
    engine = create_engine(url)
    try:
        assert await _tables(engine) == set()
        await run_migrations(engine)
        assert await _tables(engine) == TABLES
        await run_migrations(engine)  # at head already: a no-op, as on every later start
        async with engine.connect() as conn:
            columns = await conn.run_sync(
                lambda c: {col["name"] for col in inspect(c).get_columns("api_keys")}
            )
        assert "key_hash" in columns and "key" not in columns and "secret" not in columns
        await downgrade(engine)
        assert await _tables(engine) <= {"alembic_version"}
        await run_migrations(engine)
        assert await _tables(engine) == TABLES
    finally:
        await engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migrations_build_an_empty_database_and_downgrade(backend: str, tmp_path: Path) -> None:
    if backend == "sqlite":
        asyncio.run(_round_trip(f"sqlite:///{tmp_path / 'empty.db'}"))
        return
    url = fresh_pg_url()
    asyncio.run(create_postgres_database(url))
    try:
        asyncio.run(_round_trip(url))
    finally:
        asyncio.run(drop_postgres_database(url))
