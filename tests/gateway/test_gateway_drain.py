"""SIGTERM drains a real `sluice serve` (auth on, SQLite in a temporary data dir): new requests get
503 + Retry-After and /readyz 503 while the server still listens; a request that ends within the
drain timeout completes; the ones that run longer end cleanly (a stream with an SSE error event and
[DONE], a non-streamed one with a JSON 503 in the OpenAI format); every one has its usage row; the
process exits with 0. On the synthetic driver and on the native engine (slowed by a step delay so
that its long requests outlast the drain).

Nothing is timed: the short request needs about two seconds of a 20 s drain, the long ones minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from gateway_server import SLUICE

from benchmarks.server_process import ServerProcess, free_port

ADMIN = "drain-admin-key"
HANG_S = 240.0
T = TypeVar("T")

DRIVERS = {
    "synthetic": ["--driver", "synthetic", "--synthetic-tokens-per-second", "10", "--synthetic-ttft-ms", "1"],
    "native": ["--driver", "native", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1",
               "--fault-step-delay", "node-0=0.1"],
}
MODELS = {"synthetic": "synthetic", "native": "smollm2-135m-instruct"}
LONG = {"synthetic": 2000, "native": 400}  # tokens: at <= 10 tokens/s, far past the 20 s drain


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = HANG_S) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not reached within {timeout_s:.0f} s: {what}")


class Call(threading.Thread):
    """One completion, streamed or not, in the background; `lines` are its SSE data lines."""

    def __init__(self, base_url: str, headers: dict[str, str], model: str, max_tokens: int, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = f"{base_url}/v1/completions", headers
        self.body = {"model": model, "prompt": "Tell me a story", "max_tokens": max_tokens, "stream": stream,
                     "ignore_eos": True}
        self.lines: list[str] = []
        self.response: httpx.Response | None = None
        self.started = threading.Event()  # a stream's first token; a plain request's dispatch

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=HANG_S) as resp:
            self.response = resp
            if not self.body["stream"]:
                resp.read()
            for line in resp.iter_lines() if self.body["stream"] else ():
                if line.startswith("data: "):
                    self.lines.append(line)
                    if '"text"' in line:
                        self.started.set()
        self.started.set()

    def ids(self) -> set[str]:
        return {line.split('"id":"', 1)[1].split('"', 1)[0] for line in self.lines if '"id":"' in line}


@pytest.mark.parametrize("driver", ["synthetic", "native"])
def test_sigterm_drains_then_ends_what_is_left_and_keeps_its_usage(tmp_path: Path, driver: str) -> None:
    env = {"SLUICE_DATA_DIR": str(tmp_path), "SLUICE_ADMIN_KEY": ADMIN, "SLUICE_USAGE_FLUSH_MS": "50"}
    admin = {"authorization": f"Bearer {ADMIN}"}
    model = MODELS[driver]
    with ServerProcess([*DRIVERS[driver], "--drain-timeout", "20"], startup_timeout_s=300, auth=True,
                       env=env) as server:
        base = server.base_url
        tenant = httpx.post(f"{base}/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}"}, headers=admin)
        assert tenant.status_code == 201, tenant.text
        key = httpx.post(f"{base}/admin/tenants/{tenant.json()['id']}/keys", json={"name": "k"}, headers=admin)
        headers = {"authorization": f"Bearer {key.json()['key']}"}

        short = Call(base, headers, model, max_tokens=20, stream=True)
        long_stream = Call(base, headers, model, max_tokens=LONG[driver], stream=True)
        long_plain = Call(base, headers, model, max_tokens=LONG[driver], stream=False)
        for call in (short, long_stream, long_plain):
            call.start()
        for call in (short, long_stream):
            assert call.started.wait(HANG_S), "a stream produced no token"
        wait_for("three requests running", lambda: httpx.get(f"{base}/v1/engine/stats").json()["running"] >= 3 or None)

        assert server.process is not None
        os.kill(server.process.pid, signal.SIGTERM)

        # Draining: still listening, out of rotation, refusing new work with a retry hint.
        ready = wait_for("readyz 503", lambda: r if (r := httpx.get(f"{base}/readyz")).status_code == 503 else None)
        assert "draining" in ready.json()["detail"]
        refused = httpx.post(f"{base}/v1/completions", headers=headers, json={"model": model, "prompt": "hi"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert httpx.get(f"{base}/healthz").status_code == 200

        for call in (short, long_stream, long_plain):
            call.join(HANG_S)
            assert not call.is_alive(), "a request hung through the drain"
        assert short.lines[-1] == "data: [DONE]" and not any('"error"' in x for x in short.lines), short.lines[-3:]
        assert long_stream.lines[-1] == "data: [DONE]", long_stream.lines[-3:]
        assert '"error"' in long_stream.lines[-2] and "shutting down" in long_stream.lines[-2]
        assert long_plain.response is not None and long_plain.response.status_code == 503
        assert long_plain.response.headers["content-type"].startswith("application/json")
        error = long_plain.response.json()["error"]
        assert error["message"] and error["type"] == "overloaded_error"

        assert server.process.wait(HANG_S) == 0, server.log_tail()

    with sqlite3.connect(tmp_path / "sluice.db") as db:
        rows = db.execute("SELECT request_id, completion_tokens, status FROM usage_records").fetchall()
    by_id = {r[0]: r for r in rows}
    assert len(rows) == 3, rows  # the refused request never reached the service: no row
    assert by_id[short.ids().pop()][1:] == (20, "ok")
    cut = by_id[long_stream.ids().pop()]
    assert 0 < cut[1] < LONG[driver] and cut[2] == "ShuttingDownError", cut


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_drains_the_native_engines_stream(sig: signal.Signals) -> None:
    """systemd's default KillMode (control-group) and Ctrl-C in a terminal signal every process of the
    server, the engine's too. The engine leaves signals to its client (engine_native/process.py), so the
    gateway drains the stream on it to the end instead of losing it with the engine mid-drain."""
    with ServerProcess(DRIVERS["native"], startup_timeout_s=300) as server:
        assert server.process is not None
        stream = Call(server.base_url, {}, MODELS["native"], max_tokens=30, stream=True)  # ~3 s at the step delay
        stream.start()
        assert stream.started.wait(HANG_S), "the stream produced no token"
        os.killpg(server.process.pid, sig)  # its own session: the group is the server's processes
        stream.join(HANG_S)
        assert not stream.is_alive(), "the stream hung through the drain"
        assert stream.lines[-1] == "data: [DONE]", server.log_tail()
        assert not any('"error"' in line for line in stream.lines), stream.lines[-3:]
        assert sum('"text"' in line for line in stream.lines) == 30
        assert server.process.wait(HANG_S) == 0, server.log_tail()


def test_a_driver_that_fails_at_once_stops_the_server_with_status_1() -> None:
    """A model that is not there fails the driver within the lifespan's first second, before the server listens:
    the process exits with status 1, not by the SIGTERM it sent itself (uvicorn raises a signal it caught before
    listening again at its end: status 143, which systemd's Restart=on-failure takes for a clean stop), and leaves
    no engine process behind (`sluice serve` spawns it before the gateway starts)."""
    proc = subprocess.Popen(
        [SLUICE, "serve", "--driver", "native", "--no-auth", "--port", str(free_port()), "--model",
         "/nonexistent/model.gguf"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 1, (proc.returncode, out[-3000:])
        assert "the driver failed to start" in out
        # Nothing of the server is left (its engine, multiprocessing's resource tracker, which ends once its pipe
        # from the server closes): the process group empties.
        wait_for("the server's process group to empty", lambda: None if _group_alive(proc.pid) else True, timeout_s=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
