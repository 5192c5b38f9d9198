"""SGLang stand-in servers (tests/sglang/standin.py) as child processes on free ports, and the text
the stand-in's "model" produces, for the assertions."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.server_process import free_port
from tests.polling import wait_until

STANDIN = str(Path(__file__).with_name("standin.py"))


@dataclass
class StandInProcess:
    process: subprocess.Popen[bytes]
    url: str
    kv_events: str | None = None
    kv_replay: str | None = None

    @property
    def id(self) -> str:
        return self.url.removeprefix("http://")

    def state(self) -> dict[str, object]:
        result: dict[str, object] = httpx.get(self.url + "/standin/state", timeout=5).json()
        return result

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


@contextlib.contextmanager
def standins(count: int, *options: str, kv_events: bool = False) -> Iterator[list[StandInProcess]]:
    started: list[StandInProcess] = []
    try:
        for _ in range(count):
            port = free_port()
            extra: list[str] = []
            events = replay = None
            if kv_events:
                events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
                extra = ["--kv-events", events, "--kv-replay", replay]
            process = subprocess.Popen(
                [sys.executable, STANDIN, "--port", str(port), *options, *extra],
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            started.append(StandInProcess(process, f"http://127.0.0.1:{port}", events, replay))
        for s in started:
            wait_until(lambda s=s: _up(s.url), f"stand-in {s.url} up", timeout_s=30)
        yield started
    finally:
        for s in started:
            s.kill()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def expected_ids(prompt: list[int], count: int) -> list[int]:
    """The stand-in's output for `prompt` (its next_token, restated here so the tests do not trust it)."""
    out: list[int] = []
    for _ in range(count):
        context = prompt + out
        out.append(32 if len(context) % 6 == 5 else 97 + (sum(context[-3:]) * 7 + len(context)) % 26)
    return out


def text_of(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids)
