"""Starting real `sluice serve --driver synthetic` processes on free ports for the gateway tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.server_process import ServerProcess

SLUICE = str(Path(sys.executable).parent / "sluice")
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    log_tail: Callable[[], str]  # the end of the server's output so far, for a failing test's message

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def stats(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(f"{self.base_url}/v1/engine/stats").json()
        return data

    def wait_idle(self, timeout_s: float = 5.0) -> dict[str, object]:
        """Poll the driver until nothing runs or waits; return the last stats."""
        deadline = time.monotonic() + timeout_s
        stats = self.stats()
        while (stats["running"] or stats["waiting"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = self.stats()
        return stats


def start_server(
    *options: str, startup_timeout_s: float = 30, auth: bool = False, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """Options come after `--driver synthetic`, so a later `--driver native` wins. Auth is off unless
    asked for (the tenant tests turn it on and pass DATABASE_URL etc. in `env`). Ready once /readyz
    says so: a native server listens while its model still loads."""
    with ServerProcess(["--driver", "synthetic", *options], startup_timeout_s, auth, env) as server:
        assert server.process is not None
        yield Server(server.base_url, server.process, server.log_tail)


def engine_pids(server_pid: int) -> list[int]:
    """The gateway's engine processes (its multiprocessing-spawned children; not the resource tracker)."""
    pids = []
    for child in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            pids.append(int(child))
    return pids
