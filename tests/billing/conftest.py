"""Billing tests: a fresh database per test (SQLite file, or a PostgreSQL database of its own on the
real server) and a Stripe stand-in on a free port."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from stripe_standin import RunningStandIn, StripeStandIn, serve

from tenants.db import create_postgres_database, drop_postgres_database

PG_SERVER = os.environ.get("SLUICE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
METERS = {"sluice_prompt_tokens": "mtr_test_prompt", "sluice_completion_tokens": "mtr_test_completion"}


def fresh_pg_url() -> str:
    return f"{PG_SERVER.rsplit('/', 1)[0]}/sluice_billing_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    url = fresh_pg_url()
    asyncio.run(create_postgres_database(url))
    try:
        yield url
    finally:
        asyncio.run(drop_postgres_database(url))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test on the embedded SQLite database and on real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'billing.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def stripe_standin() -> Iterator[RunningStandIn]:
    running = serve(StripeStandIn(METERS))
    try:
        yield running
    finally:
        running.stop()
