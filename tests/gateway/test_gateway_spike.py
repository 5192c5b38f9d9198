"""A traffic spike through the real server: `sluice serve --driver native` with a small queue, 1,000
concurrent streaming requests. Every request ends in a complete stream or a 429/503 with Retry-After,
nothing else; the server answers afterwards and its engine holds no KV blocks once idle."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from gateway_server import Server, start_server

SPIKE = 1_000
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def native() -> Iterator[Server]:
    yield from start_server(
        "--driver",
        "native",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "32",
        "--max-waiting",
        "64",
        "--kv-cache-memory",
        "64MiB",
        "--num-threads",
        "2",
        startup_timeout_s=240,
    )


async def _one(client: httpx.AsyncClient, i: int) -> str:
    body = {
        "messages": [{"role": "user", "content": f"Say a word about the number {i}."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "priority": i % 3,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            assert resp.status_code in (429, 503), (resp.status_code, resp.text)
            assert int(resp.headers["retry-after"]) >= 1
            return f"refused {resp.status_code}"
        events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finish[-1] in ("stop", "length") and all(f is None for f in finish[:-1])
    return "completed"


async def _spike(base_url: str) -> Counter[str]:
    limits = httpx.Limits(max_connections=SPIKE, max_keepalive_connections=SPIKE)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(_one(client, i) for i in range(SPIKE)))
    return Counter(results)


@pytest.mark.timeout(240)
def test_a_thousand_concurrent_streams_complete_or_are_refused_with_retry_after(native: Server) -> None:
    outcomes = asyncio.run(_spike(native.base_url))
    assert sum(outcomes.values()) == SPIKE
    assert outcomes["completed"] > 0 and set(outcomes) <= {"completed", "refused 429", "refused 503"}

    # Still serving afterwards.
    resp = httpx.post(f"{native.v1}/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] is not None
    stats = native.wait_idle(timeout_s=30)
    assert stats["running"] == 0 and stats["waiting"] == 0
    # kv_blocks_used counts referenced blocks; prefix-cached blocks nobody holds are free (evictable).
    assert stats["kv_blocks_used"] == 0
    assert stats["ready"] is True
