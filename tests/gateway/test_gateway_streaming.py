"""SSE framing, disconnects, overload and concurrency against real server processes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from gateway_server import Server


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


@pytest.mark.parametrize("n", [1, 2])  # n=2 runs pump tasks that only an explicit close stops
def test_client_disconnect_aborts_the_generation(slow_server: Server, n: int) -> None:
    body = {"model": "synthetic", "prompt": "long one", "max_tokens": 400, "stream": True, "n": n}
    with httpx.stream("POST", slow_server.v1 + "/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert slow_server.stats()["running"] == n
    # 400 tokens at 20/s would run for 20 s; a prompt abort frees the slot within a moment.
    started = time.monotonic()
    stats = slow_server.wait_idle(timeout_s=3)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert time.monotonic() - started < 3


def test_overload_is_503_with_retry_after(slow_server: Server) -> None:
    # 2 running + 2 waiting fit; the rest must be shed immediately with 503 + Retry-After.
    body = {"model": "synthetic", "prompt": "x", "max_tokens": 30, "stream": True}
    statuses: list[int] = []
    shed: list[httpx.Response] = []
    stop = threading.Event()
    lock = threading.Lock()

    def hold() -> None:
        with httpx.stream("POST", slow_server.v1 + "/completions", json=body, timeout=10) as resp:
            with lock:
                statuses.append(resp.status_code)
            if resp.status_code != 200:
                resp.read()
                with lock:
                    shed.append(resp)
                return
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold) for _ in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # let each one be admitted (or refused) in order
    deadline = time.monotonic() + 5
    while len(statuses) < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(10)
    assert sorted(statuses) == [200] * 4 + [503] * 4, statuses
    for resp in shed:
        assert int(resp.headers["retry-after"]) >= 1
        error = resp.json()["error"]
        assert error["type"] == "overloaded_error" and error["code"] == "overloaded"
    assert slow_server.wait_idle()["running"] == 0
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
