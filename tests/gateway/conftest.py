"""Session-wide synthetic servers for the gateway tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from edge_server import EdgeServer, start_edge_server
from gateway_server import MAX_BODY_BYTES, MAX_MODEL_LEN, Server, start_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """Fast synthetic engine: ~2,000 tokens/s per request, small context and body cap."""
    yield from start_server(
        "--synthetic-tokens-per-second",
        "2000",
        "--synthetic-ttft-ms",
        "2",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--max-num-seqs",
        "256",
        "--max-waiting",
        "256",
    )


@pytest.fixture(scope="session")
def slow_server() -> Iterator[Server]:
    """Slow engine with a tiny queue (2 running + 2 waiting): for overload and disconnects."""
    yield from start_server(
        "--synthetic-tokens-per-second",
        "20",
        "--synthetic-ttft-ms",
        "10",
        "--max-num-seqs",
        "2",
        "--max-waiting",
        "2",
    )


@pytest.fixture(scope="session")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeServer]:
    """Auth on (SQLite), a tenant and its key, a metrics token, tenants labelled by name, a 2 s body
    deadline: for the tests of the HTTP edge and the OpenAPI schema."""
    yield from start_edge_server(tmp_path_factory.mktemp("edge-db"), SLUICE_METRICS_TENANT_LABEL="name")
