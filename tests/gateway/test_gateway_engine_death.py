"""The engine process dies mid-stream: streams end with an error event, new requests fail fast
with 503, liveness stays up and readiness goes down. Nothing hangs."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_server import Server, start_server

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def native() -> Iterator[Server]:
    yield from start_server(
        "--driver", "native", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1",
        startup_timeout_s=240,
    )


def engine_pids(server_pid: int) -> list[int]:
    """Child processes of the gateway: its engine process(es)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def test_engine_death_fails_streams_and_new_requests_fast(native: Server) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    pids = engine_pids(native.process.pid)
    assert pids, "the native driver runs its engine in a child process"
    events: list[str] = []
    with httpx.stream("POST", f"{native.v1}/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
        # the iteration ended by itself: no hang until the client's timeout
    assert events[-1] == "data: [DONE]"
    assert any('"error"' in e for e in events[-3:]), events[-3:]

    started = time.monotonic()
    after = httpx.post(f"{native.v1}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=10)
    assert after.status_code == 503 and time.monotonic() - started < 2
    assert after.json()["error"]["message"]
    assert httpx.get(f"{native.base_url}/healthz").status_code == 200
    assert httpx.get(f"{native.base_url}/readyz").status_code == 503
