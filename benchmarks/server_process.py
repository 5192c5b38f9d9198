"""A `sluice serve` child process on a free port, for the benchmarks that compare server settings.

with ServerProcess(["--driver", "native", "--max-num-seqs", "8"]) as server:
    run_benchmark(BenchConfig(base_url=server.base_url, ...))
    server.peak_rss_bytes()   # VmHWM of the gateway and its engine processes
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """The one way our benchmarks start `sluice serve`: free port, own process group, output to a
    temporary log (quoted when it fails), ready only once /readyz says so, stopped on exit."""

    def __init__(
        self,
        options: list[str],
        startup_timeout_s: float = 300.0,
        auth: bool = False,
        env: dict[str, str] | None = None,
        ready_path: str = "/readyz",
    ) -> None:
        """`ready_path`: the probe that must answer 200 before the server counts as up (/healthz for a
        server that listens long before it can serve, e.g. while it waits for a worker)."""
        self.ready_path = ready_path
        self.options = options
        self.startup_timeout_s = startup_timeout_s
        self.auth = auth
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

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
        # A file, not a pipe: nobody reads the server's output while it runs, and a full pipe blocks it.
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}{self.ready_path}", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"sluice serve not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        if self._log is None:
            return ""
        # pread, not seek + read: the server writes through this same open file, so moving its offset would
        # move where the server's next line lands (over the start of the log) while it still runs.
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")[-chars:]

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """SIGTERM lets the server shut its engines down; its process group is killed if anything lingers."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(15)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

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
