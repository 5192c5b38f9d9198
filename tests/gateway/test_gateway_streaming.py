"""SSE framing, disconnects, overload and concurrency against real server processes.

No test here asserts how long something took or sleeps to order events: each waits for the state it
needs (polling the engine's stats) under a deadline that only catches a hang."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest
from gateway_server import Server

from benchmarks.sse_lines import sse_lines
from gateway.render import sse


def test_sse_framing_is_byte_exact(server: Server) -> None:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 3,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = httpx.post(server.v1 + "/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    first = json.loads(resp.content.split(b"\n\n", 1)[0][len(b"data: ") :])
    rid, created = first["id"], first["created"]
    assert resp.headers["x-request-id"] == rid
    head = (
        f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},"model":"synthetic","choices":'
    )
    expected = (
        f'data: {head}[{{"index":0,"delta":{{"role":"assistant","content":""}},"finish_reason":null,"logprobs":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{"content":"gasa"}},"finish_reason":null,"logprobs":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{"content":" zepi"}},"finish_reason":null,"logprobs":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{"content":" dile"}},"finish_reason":"length","logprobs":null}}]}}\n\n'
        f'data: {head}[],"usage":{{"prompt_tokens":6,"completion_tokens":3,"total_tokens":9}}}}\n\n'
        "data: [DONE]\n\n"
    )
    assert resp.content == expected.encode()


def wait_for(server: Server, done: Callable[[dict[str, Any]], bool], timeout_s: float = 60) -> dict[str, Any]:
    """Poll the engine's stats until `done`; the deadline only catches a hang."""
    deadline = time.monotonic() + timeout_s
    while not done(stats := server.stats()):
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    return stats


@pytest.mark.parametrize("n", [1, 2])  # n=2 runs pump tasks that only an explicit close stops
def test_client_disconnect_aborts_the_generation(slow_server: Server, n: int) -> None:
    # 3,000 tokens at 20/s would run for two and a half minutes: only an abort frees the slots within
    # the deadline below, however slow the machine.
    body = {"model": "synthetic", "prompt": "long one", "max_tokens": 3_000, "stream": True, "n": n}
    with httpx.stream("POST", slow_server.v1 + "/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert slow_server.stats()["running"] == n
    wait_for(slow_server, lambda s: s["running"] == 0 and s["waiting"] == 0)


def test_overload_is_503_with_retry_after(slow_server: Server) -> None:
    # 2 running + 2 waiting fit; the rest must be refused at once with 503 + Retry-After.
    url = slow_server.v1 + "/completions"
    long = {"model": "synthetic", "prompt": "x", "max_tokens": 3_000, "stream": True}
    short = {"model": "synthetic", "prompt": "x", "max_tokens": 3}
    wait_for(slow_server, lambda s: s["running"] == 0 and s["waiting"] == 0)
    with ExitStack() as running, ThreadPoolExecutor(2) as pool:
        for _ in range(2):
            resp = running.enter_context(httpx.stream("POST", url, json=long, timeout=60))
            assert resp.status_code == 200  # the headers come with the first chunk: it runs
        queued = [pool.submit(httpx.post, url, json=short, timeout=60) for _ in range(2)]
        wait_for(slow_server, lambda s: s["waiting"] == 2)
        shed = [httpx.post(url, json=short, timeout=60) for _ in range(4)]
        for refused in shed:
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["type"] == "overloaded_error" and error["code"] == "overloaded"
        running.close()  # the long streams go: the queued requests get their slots
        assert [f.result().status_code for f in queued] == [200, 200]
    wait_for(slow_server, lambda s: s["running"] == 0)
    client = openai.OpenAI(base_url=slow_server.v1, api_key="unused", max_retries=0)
    assert client.completions.create(model="synthetic", prompt="x", max_tokens=1).choices[0].text


def test_fifty_concurrent_streams_finish_with_correct_lengths(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        want = 20 + i % 13
        stream = await client.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=want,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return want, len(text.split()), usage

    async def main() -> list[tuple[int, int, int]]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(want == words == usage for want, words, usage in results), results
    assert server.wait_idle()["running"] == 0


def test_text_with_unicode_line_separators_stays_one_event_line_for_every_line_reader() -> None:
    """Generated text may hold U+0085 / U+2028 / U+2029, which JSON allows raw and str.splitlines()
    (httpx's aiter_lines) takes for line ends. The gateway escapes them; the benchmark clients split
    lines only where SSE does, so another server's raw ones do not break them either."""
    text = "one\u2028two\x85three\u2029four\r"
    event = sse({"choices": [{"text": text}]})
    lines = event.decode().splitlines()
    assert lines == [lines[0], ""] and json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text

    raw = b'data: {"text":"a\xe2\x80\xa8b\xc2\x85c"}\r\n\r\ndata: [DONE]\n\n'  # another server's raw separators

    async def read() -> list[str]:
        return [line async for line in sse_lines(httpx.Response(200, content=raw))]
    got = asyncio.run(read())
    assert [json.loads(x[6:])["text"] for x in got if x.startswith("data: {")] == ["a\u2028b\x85c"]
    assert "data: [DONE]" in got
