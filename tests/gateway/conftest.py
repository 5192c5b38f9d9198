"""Session-wide synthetic servers for the gateway tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
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
