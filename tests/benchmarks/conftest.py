"""Synthetic servers for the benchmark tests (`gateway_server` lives beside the gateway tests)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))

from gateway_server import Server, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Fast synthetic engine: a few ms per token, so a run of 4 prompts takes well under a second."""
    yield from start_server("--synthetic-tokens-per-second", "500", "--synthetic-ttft-ms", "5")


@pytest.fixture(scope="module")
def slow_server() -> Iterator[Server]:
    """Slow engine with a tiny queue (2 running + 2 waiting): 8 requests at once get 4 refusals."""
    yield from start_server(
        "--synthetic-tokens-per-second", "20", "--synthetic-ttft-ms", "10", "--max-num-seqs", "2",
        "--max-waiting", "2",
    )
