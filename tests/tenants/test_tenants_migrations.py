"""Alembic migrations build an empty database on SQLite and PostgreSQL, and downgrade cleanly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine
from tenant_db import fresh_pg_url

from tenants.db import (
    create_engine,
    create_postgres_database,
    downgrade,
    drop_postgres_database,
    run_migrations,
)

TABLES = {
    "tenants", "api_keys", "usage_records", "admin_credentials", "billing_lines", "billing_events", "alembic_version",
    "registry_models", "registry_versions", "registry_generations", "registry_changes", "registry_tenant_access",
}


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


async def _upgrade_keeps_data(url: str) -> None:
    engine = create_engine(url)
    try:
        await run_migrations(engine, "0001")
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO tenants VALUES ('t1', 'acme', 1, 60, 1000, 8, NULL, 'active', "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO api_keys (id, tenant_id, name, prefix, key_hash, created_at) "
                    "VALUES ('k1', 't1', 'k', 'sk-sluice-abcd', 'hash', CURRENT_TIMESTAMP)"
                )
            )
        await run_migrations(engine)
        async with engine.begin() as conn:
            assert (await conn.execute(text("SELECT weight FROM tenants"))).scalar_one() == 1.0
            assert (await conn.execute(text("SELECT count(*) FROM api_keys"))).scalar_one() == 1
            # 64-bit limits and usage ids (a 32-bit column refused these on PostgreSQL).
            await conn.execute(
                text("UPDATE tenants SET requests_per_minute = 3000000000, tokens_per_minute = 1099511627776")
            )
            await conn.execute(
                text(
                    "INSERT INTO usage_records (id, request_id, tenant_id, model, prompt_tokens, "
                    "completion_tokens, latency_ms, status, created_at) "
                    "VALUES (3000000000, 'r', 't1', 'm', 1, 1, 1.0, 'ok', CURRENT_TIMESTAMP)"
                )
            )
            limits = (
                await conn.execute(text("SELECT requests_per_minute, tokens_per_minute FROM tenants"))
            ).one()
            assert tuple(limits) == (3_000_000_000, 2**40)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_upgrade_to_weights_keeps_tenants_and_keys(backend: str, tmp_path: Path) -> None:
    """0002 adds `weight` (1.0 for existing tenants) and widens limits without touching the keys;
    on SQLite rebuilding `tenants` would have cascaded its DROP into `api_keys`."""
    if backend == "sqlite":
        asyncio.run(_upgrade_keeps_data(f"sqlite:///{tmp_path / 'old.db'}"))
        return
    url = fresh_pg_url()
    asyncio.run(create_postgres_database(url))
    try:
        asyncio.run(_upgrade_keeps_data(url))
    finally:
        asyncio.run(drop_postgres_database(url))
