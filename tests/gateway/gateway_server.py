"""Starting real `sluice serve --driver synthetic` processes on free ports for the gateway tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

SLUICE = str(Path(sys.executable).parent / "sluice")
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Server:
    base_url: str
    process: subprocess.Popen[bytes]

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    *options: str, startup_timeout_s: float = 30, auth: bool = False, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """Options come after `--driver synthetic`, so a later `--driver native` wins. Auth is off unless
    asked for (the tenant tests turn it on and pass DATABASE_URL etc. in `env`)."""
    port = _free_port()
    cmd = [
        SLUICE,
        "serve",
        "--driver",
        "synthetic",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "WARNING",
        *([] if auth else ["--no-auth"]),
        *options,
    ]
    process = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})}
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stderr.read().decode() if process.stderr else ''}")
        try:
            # ready, not just alive: a native server listens while its model still loads
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("server did not come up")
        time.sleep(0.1)
    try:
        yield Server(base, process)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
