"""The gateway serves on uvloop and httptools (gateway/server_choice.py), not on uvicorn's fallbacks;
tests/fleet/test_fleet_worker.py checks `sluice worker` likewise."""

from __future__ import annotations

from pathlib import Path

import httpx
from gateway_server import Server


def _loaded(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_served_stream_runs_on_uvloop_and_httptools(server: Server) -> None:
    with httpx.stream("POST", f"{server.v1}/completions", timeout=30,
                      json={"model": "synthetic", "prompt": "hi", "max_tokens": 4, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    maps = _loaded(server.process.pid)
    # The compiled modules themselves: uvicorn imports neither unless it runs on them (loop="uvloop",
    # http="httptools"); with "auto" and either missing it would have served on asyncio / h11 instead.
    assert "uvloop/loop." in maps
    assert "httptools/parser/parser." in maps

