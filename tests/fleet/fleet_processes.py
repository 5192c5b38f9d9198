"""Real `sluice worker` / `sluice serve --driver fleet` processes and a private Redis, on free ports,
for the fleet tests; and a streamed completion client that keeps every chunk."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from benchmarks.server_process import ServerProcess, free_port
from benchmarks.worker_process import WorkerProcess, worker_processes

SLUICE = str(Path(sys.executable).parent / "sluice")
HANG_S = 60.0  # a deadline that only catches hangs
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = HANG_S) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            value = probe()
            if value is not None and value is not False:
                return value
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout_s:.0f} s: {what}")


def workers(count: int, *options: str, prefix: str = "w", env: dict[str, str] | None = None,
            startup_timeout_s: float = HANG_S) -> contextlib.AbstractContextManager[list[WorkerProcess]]:
    """`count` workers started side by side (model loads overlap), all ready."""
    return worker_processes(count, *options, prefix=prefix, env=env, startup_timeout_s=startup_timeout_s)


@contextlib.contextmanager
def gateway(*options: str, env: dict[str, str] | None = None, startup_timeout_s: float = HANG_S) -> Iterator[str]:
    """`sluice serve --no-auth --driver fleet ...`; yields its base URL."""
    with ServerProcess(["--driver", "fleet", *options], startup_timeout_s, False, env) as server:
        yield server.base_url


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        wait_for("redis up", lambda: client.ping(), 20)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait(5)


@dataclass
class Stream:
    """One streamed completion in a thread: its text pieces, finish reason and usage."""

    base_url: str
    body: dict[str, object]
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {**self.body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=HANG_S) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}: {response.read().decode()}"
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        self.error = str(data["error"])
                        continue
                    for choice in data.get("choices", []):
                        self.pieces.append(choice["text"])
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        if len(self.pieces) >= 3:
                            self.started.set()
                    if data.get("usage"):
                        self.completion_tokens = data["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    def join(self) -> Stream:
        assert self.thread is not None
        self.thread.join(HANG_S)
        assert not self.thread.is_alive(), "stream hung"
        return self

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def nodes(base_url: str) -> list[dict[str, object]]:
    data: list[dict[str, object]] = httpx.get(f"{base_url}/admin/nodes", timeout=5).json()["nodes"]
    return data


def node_state(base_url: str, worker_id: str) -> str | None:
    """The worker's state in this gateway's view (joining, ready, draining); None while it is not in the view."""
    return next((str(n["state"]) for n in nodes(base_url) if n["id"] == worker_id), None)


def busiest(base_url: str) -> str:
    """The id of the worker this gateway has the most streams open on."""
    return str(max(nodes(base_url), key=lambda n: int(str(n["in_flight"])))["id"])
