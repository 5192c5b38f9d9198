"""A bounded schema fuzz run: schemathesis generates requests, valid and invalid, from the OpenAPI
schema a real `sluice serve` (auth on) serves, and checks every answer: never a 5xx, and status,
content type, headers and body as the schema documents them.

Bounded by examples per operation and a fixed seed, so a run is reproducible and takes about a
minute; SLUICE_FUZZ_EXAMPLES and SLUICE_FUZZ_SEED widen or vary it (e.g. 500 examples, a new seed,
before a release). The tenant operations run first: the admin run's stateful phase may suspend or
delete tenants, the fuzzing tenant's own among them. The admin operations also run against
PostgreSQL, whose 32-bit integer and bounded VARCHAR columns refuse what SQLite stores.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from edge_server import ADMIN_KEY, METRICS_TOKEN, EdgeServer, start_edge_server

from tenants.db import create_postgres_database, drop_postgres_database

SCHEMATHESIS = str(Path(sys.executable).parent / "st")
EXAMPLES = os.environ.get("SLUICE_FUZZ_EXAMPLES", "25")
SEED = os.environ.get("SLUICE_FUZZ_SEED", "9")
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance"
)
ADMIN_PATHS = "^/(admin|metrics)"
PG_SERVER = os.environ.get("SLUICE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeServer]:
    yield from start_edge_server(tmp_path_factory.mktemp("fuzz-db"))


@pytest.fixture(scope="module")
def fuzzed_on_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeServer]:
    url = f"{PG_SERVER.rsplit('/', 1)[0]}/sluice_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_postgres_database(url))
    try:
        yield from start_edge_server(tmp_path_factory.mktemp("fuzz-pg"), DATABASE_URL=url)
    finally:
        asyncio.run(drop_postgres_database(url))


def fuzz(server: EdgeServer, key: str, paths: list[str], workdir: Path) -> None:
    command = [
        SCHEMATHESIS, "run", f"{server.base_url}/schema/openapi.json",
        "--header", f"Authorization: Bearer {key}",
        "--max-examples", EXAMPLES, "--seed", SEED, "--workers", "1",
        "--checks", CHECKS, "--continue-on-failure",
        "--request-timeout", "60",  # catches a hang; no request should come near it
        *paths,
    ]
    # cwd: schemathesis keeps its example database and reports in the working directory
    result = subprocess.run(command, check=False, cwd=workdir, capture_output=True, text=True, timeout=1200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-30_000:]
    # An operation that only ever saw 401/403 was not fuzzed at all.
    assert "Authentication failed" not in output, output[-30_000:]


def test_openai_and_tenant_operations_answer_every_fuzzed_request_as_documented(
    fuzzed: EdgeServer, tmp_path: Path
) -> None:
    fuzz(fuzzed, fuzzed.tenant_key, ["--exclude-path-regex", ADMIN_PATHS], tmp_path)


def test_admin_operations_answer_every_fuzzed_request_as_documented(fuzzed: EdgeServer, tmp_path: Path) -> None:
    fuzz(fuzzed, ADMIN_KEY, ["--include-path-regex", ADMIN_PATHS], tmp_path)


def test_admin_operations_on_postgres_answer_every_fuzzed_request_as_documented(
    fuzzed_on_postgres: EdgeServer, tmp_path: Path
) -> None:
    fuzz(fuzzed_on_postgres, ADMIN_KEY, ["--include-path-regex", ADMIN_PATHS], tmp_path)


def test_metrics_token_alone_reads_metrics_in_a_fuzz_run(fuzzed: EdgeServer, tmp_path: Path) -> None:
    fuzz(fuzzed, METRICS_TOKEN, ["--include-path", "/metrics"], tmp_path)
