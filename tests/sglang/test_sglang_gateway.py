"""`sluice serve --driver sglang` over two SGLang stand-ins, through HTTP: streamed chat with usage
(cached prompt tokens included), a client that disconnects (the abort reaches the server), a bad
request as 400, and 503 + Retry-After when every server is down."""

from __future__ import annotations

import json

import httpx
import pytest
from standin_process import standins

from benchmarks.server_process import ServerProcess
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(180)  # a hang fails this module's test, not the whole run
SYSTEM = "You are a terse assistant. Answer in one short line, no preamble. "


def chat(base: str, content: str, **extra: object) -> httpx.Response:
    body = {"model": "standin", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": 8, **extra}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


def test_gateway_serves_sglang_with_usage_abort_and_errors() -> None:
    with standins(2, "--token-delay-ms", "10", "--context-length", "256") as servers, ServerProcess(
        ["--driver", "sglang", "--sglang-servers", ",".join(s.url for s in servers)], startup_timeout_s=60,
    ) as gateway:
        base = gateway.base_url
        first = chat(base, "hello")
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["finish_reason"] == "length"

        events = []
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30, json={
            "model": "standin", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "again"}],
        }) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 8
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 64  # the shared system prompt, from SGLang's cache
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])

        nodes = httpx.get(base + "/admin/nodes", timeout=10).json()["nodes"]  # the servers as nodes, for operators
        assert {n["id"] for n in nodes} == {s.id for s in servers}
        assert all(n["state"] == "ready" and n["circuit"] == "closed" for n in nodes)

        # A client that goes away mid-stream: the server hears of it.
        with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
            "model": "standin", "prompt": "write forever", "max_tokens": 200, "stream": True,
        }) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: any(s.state()["aborted"] for s in servers), "an abort reached a stand-in")

        too_long = chat(base, "x" * 400)
        assert too_long.status_code == 400, too_long.text

        for s in servers:
            httpx.post(s.url + "/standin/health", json={"ok": False})
        wait_until(lambda: chat(base, "anyone?").status_code == 503, "503 once every server is down")
        refused = chat(base, "anyone?")
        assert refused.headers.get("retry-after")
