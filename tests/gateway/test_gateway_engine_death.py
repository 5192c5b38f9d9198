"""Engine processes die (kill -9) under load and come back without anyone's help.

Two engines: the streams of the killed one end with an error event, the other engine keeps serving
meanwhile (/readyz 200, degraded), and the killed node comes back and serves again. One engine:
requests get 503 while it is down, /healthz stays 200, and it comes back; killed again within the
crash-loop window, the supervisor gives up and /healthz fails so that an orchestrator restarts it.

No timing is asserted: every wait polls for a state with a deadline that only catches a hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest
from gateway_server import Server, engine_pids, start_server

MODEL = "smollm2-135m-instruct"
# A restart backoff that leaves the down state long enough to look at (a restart also loads the model).
OPTIONS = ("--driver", "native", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1",
           "--engine-restart-backoff", "2")
HANG_S = 240.0  # a deadline that only catches a hang (a restart loads the model on a busy 2-core box)

T = TypeVar("T")


@pytest.fixture(scope="module")
def two_engines() -> Iterator[Server]:
    yield from start_server(*OPTIONS, "--engines", "2", startup_timeout_s=300)


@pytest.fixture(scope="module")
def one_engine() -> Iterator[Server]:
    yield from start_server(*OPTIONS, "--engines", "1", "--engine-max-failures", "2",
                            "--engine-failure-window", "3600", startup_timeout_s=300)


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = HANG_S) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not reached within {timeout_s:.0f} s: {what}")


def nodes(server: Server) -> dict[str, dict[str, object]]:
    report = httpx.get(f"{server.base_url}/admin/nodes", timeout=30).json()
    return {n["id"]: n for n in report["nodes"]}


def complete(server: Server, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{server.v1}/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True})


class Stream(threading.Thread):
    """One streamed completion, its SSE data lines collected; `started` is set at the first token."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.events: list[str] = []
        self.started = threading.Event()
        self.status = 0

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{self.server.v1}/completions", json=body, timeout=HANG_S) as resp:
            self.status = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line)
                    if '"text"' in line:
                        self.started.set()
        self.started.set()

    @property
    def failed(self) -> bool:
        return any('"error"' in e for e in self.events[-3:])


def run_streams(server: Server, n: int, max_tokens: int = 150) -> list[Stream]:
    """`n` streams, returned once each has its first token (long enough to be cut by a kill)."""
    streams = [Stream(server, max_tokens) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(HANG_S), "a stream produced no token"
    return streams


def finish(streams: list[Stream]) -> None:
    for s in streams:
        s.join(HANG_S)
        assert not s.is_alive(), "a stream hung"
        assert s.status == 200 and s.events[-1] == "data: [DONE]", s.events[-3:]


def test_two_engines_one_killed_the_other_serves_and_it_comes_back(two_engines: Server) -> None:
    server = two_engines
    before = engine_pids(server.process.pid)
    assert len(before) == 2
    streams = run_streams(server, 8)
    victim = before[0]
    os.kill(victim, signal.SIGKILL)

    # Degraded but ready: the answer that says a node is down is itself a 200.
    ready = wait_for("readyz reports the dead engine", lambda: (
        r if (r := httpx.get(f"{server.base_url}/readyz", timeout=30)).json().get("degraded") else None))
    assert ready.status_code == 200, ready.text
    assert "restarting" in ready.json()["detail"]
    dead = wait_for("a node reported dead", lambda: next(
        (i for i, n in nodes(server).items() if n["status"] == "dead"), None))
    assert complete(server).status_code == 200  # served meanwhile (by the other engine, or the restarted one)
    assert httpx.get(f"{server.base_url}/healthz", timeout=30).status_code == 200

    finish(streams)
    failed = [s for s in streams if s.failed]
    assert failed and len(failed) < len(streams), "the killed engine's streams fail, the other's complete"

    # Back without manual action: a new process, the node healthy again, and it serves.
    wait_for("the killed node back", lambda: nodes(server)[dead]["status"] == "healthy" or None)
    after = engine_pids(server.process.pid)
    assert len(after) == 2 and victim not in after
    assert nodes(server)[dead]["restarts"] == 1
    assert httpx.get(f"{server.base_url}/readyz", timeout=30).json()["degraded"] is False
    finish(run_streams(server, 4, max_tokens=16))  # least-loaded routing puts some of them on the restarted node
    assert nodes(server)[dead]["itl_p50_ms"] is not None, "the restarted node served tokens"
    events = httpx.get(f"{server.base_url}/admin/nodes", timeout=30).json()["events"]
    assert [e["kind"] for e in events if e["node"] == dead][-1] == "restarted"


def test_one_engine_comes_back_and_a_crash_loop_fails_liveness(one_engine: Server) -> None:
    server = one_engine
    [pid] = engine_pids(server.process.pid)
    streams = run_streams(server, 2)
    os.kill(pid, signal.SIGKILL)
    finish(streams)
    assert all(s.failed for s in streams)

    # Down: nothing can serve, so not ready and new requests get 503 at once; alive all the same.
    wait_for("readyz 503", lambda: httpx.get(f"{server.base_url}/readyz", timeout=30).status_code == 503 or None)
    refused = complete(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead", refused.text
    assert httpx.get(f"{server.base_url}/healthz", timeout=30).status_code == 200

    wait_for("readyz 200 again", lambda: httpx.get(f"{server.base_url}/readyz", timeout=30).status_code == 200 or None)
    assert complete(server).status_code == 200
    [again] = engine_pids(server.process.pid)
    assert again != pid

    # The second death within the window (--engine-max-failures 2) is a crash loop: given up for good.
    os.kill(again, signal.SIGKILL)
    health = wait_for("healthz 503", lambda: (
        r if (r := httpx.get(f"{server.base_url}/healthz", timeout=30)).status_code == 503 else None))
    assert "failed for good" in health.json()["detail"]
    assert httpx.get(f"{server.base_url}/readyz", timeout=30).status_code == 503
    assert "given up" in (nodes(server)["node-0"]["reason"] or "")
    assert complete(server).status_code == 503
