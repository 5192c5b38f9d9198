"""A `sluice worker` child process on a free port, for the fleet benchmark and the fleet tests.

with WorkerProcess("w0", ["--driver", "synthetic"]) as worker:
    ... worker.url ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

from benchmarks.server_process import free_port


class WorkerProcess:
    """`sluice worker` in its own process group, output to a temporary log; ready once /readyz says so."""

    def __init__(self, worker_id: str, options: list[str], env: dict[str, str] | None = None,
                 startup_timeout_s: float = 60.0, wait: bool = True, host: str = "127.0.0.1",
                 wrapper: list[str] | None = None) -> None:
        """`host`: the address it binds and is reached at; `wrapper`: a command it runs under (e.g.
        `ip netns exec NS`, a worker in its own network namespace)."""
        self.worker_id = worker_id
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        sluice = str(Path(sys.executable).parent / "sluice")
        cmd = [*(wrapper or []), sluice, "worker", "--host", host, "--port", str(self.port), "--worker-id", worker_id,
               "--log-level", "WARNING", *options]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        if wait:
            self.wait_ready(startup_timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Until /readyz says 200; stops the process and raises if it exits or takes too long."""
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice worker exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"sluice worker not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        if self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT: a stopped process cannot handle it); the group is killed if it lingers."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if not self._log.closed:
            self._log.close()

    def served(self) -> int:
        """Generate streams this worker finished (its own /metrics)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith('sluice_worker_requests_total{outcome="finished"}'):
                total += float(line.split()[-1])
        return int(total)


@contextlib.contextmanager
def worker_processes(count: int, *options: str, prefix: str = "w", env: dict[str, str] | None = None,
                     startup_timeout_s: float = 60.0) -> Iterator[list[WorkerProcess]]:
    """`count` workers started side by side (model loads overlap), all ready."""
    started: list[WorkerProcess] = []
    try:
        for i in range(count):
            started.append(WorkerProcess(f"{prefix}{i}", list(options), env, startup_timeout_s, wait=False))
        for w in started:
            w.wait_ready(startup_timeout_s)
        yield started
    finally:
        for w in started:
            w.stop()
