"""The gateway serves on uvloop and httptools (gateway/server_choice.py), not on uvicorn's fallbacks;
tests/fleet/test_fleet_worker.py checks `sluice worker` likewise."""

from __future__ import annotations

import httpx
from gateway_server import Server

from tests.server_choice import runs_on_uvloop_and_httptools


def test_a_served_stream_runs_on_uvloop_and_httptools(server: Server) -> None:
    with httpx.stream("POST", f"{server.v1}/completions", timeout=30,
                      json={"model": "synthetic", "prompt": "hi", "max_tokens": 4, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    assert runs_on_uvloop_and_httptools(server.process.pid)
