"""A `sluice serve` child process on a free port, for the benchmarks that compare server settings.

with ServerProcess(["--driver", "native", "--max-num-seqs", "8"]) as server:
    run_benchmark(BenchConfig(base_url=server.base_url, ...))
    server.peak_rss_bytes()   # VmHWM of the gateway and its engine processes
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    def __init__(self, options: list[str], startup_timeout_s: float = 300.0, auth: bool = False) -> None:
        self.options = options
        self.startup_timeout_s = startup_timeout_s
        self.auth = auth
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        sluice = str(Path(sys.executable).parent / "sluice")
        cmd = [
            sluice,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "WARNING",
            *([] if self.auth else ["--no-auth"]),
            *self.options,
        ]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"server exited: {err[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("server did not come up")
            time.sleep(0.2)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def stats(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(f"{self.base_url}/v1/engine/stats", timeout=10).json()
        return data

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        stats = self.stats()
        while (stats["running"] or stats["waiting"]) and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = self.stats()
        return stats

    def pids(self) -> list[int]:
        """The gateway and its descendants (the engine processes)."""
        if self.process is None:
            return []
        found, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                todo.extend(int(c) for c in task.read_text().split())
        return found

    def peak_rss_bytes(self) -> dict[int, int]:
        """VmHWM (peak resident set) of each process, by pid."""
        peaks = {}
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peaks[pid] = int(line.split()[1]) * 1024
            except OSError:
                continue
        return peaks


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()
