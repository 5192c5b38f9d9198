"""Databases for the tenant tests: a SQLite file and a fresh PostgreSQL database per session.

PostgreSQL is the real server (see tenant_db.py); each session creates its own
database there and drops it afterwards. Tests are sync
functions that `asyncio.run` a scenario, so every engine lives on one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from tenant_db import fresh_pg_url

from tenants.db import create_postgres_database, drop_postgres_database


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    url = fresh_pg_url()
    asyncio.run(create_postgres_database(url))
    try:
        yield url
    finally:
        asyncio.run(drop_postgres_database(url))


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("sluice-db") / "sluice.db"
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The same test on the embedded SQLite database and on real PostgreSQL."""
    url: str = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of this test's own, on SQLite and on PostgreSQL: for tests that change
    the schema or the server's settings of their database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'own.db'}"
        return
    url = fresh_pg_url()
    asyncio.run(create_postgres_database(url))
    try:
        yield url
    finally:
        asyncio.run(drop_postgres_database(url))
