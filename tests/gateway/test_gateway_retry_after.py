"""Retry-After of a queue-full refusal comes from the engine's measured figures (drivers/retry_after.py):
the work queued ahead of the request over the engine's recent throughput, bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_server import Server, start_server

from drivers import retry_after

MODEL = "smollm2-135m-instruct"
HANG_S = 240.0


def test_the_longer_the_work_ahead_the_longer_the_wait() -> None:
    waits = [retry_after.retry_after_s(tokens, tokens_per_s=100.0) for tokens in (50, 300, 1200, 3000, 10_000)]
    assert waits == sorted(waits) and waits[1] < waits[2] < waits[3]
    assert waits[0] == retry_after.MIN_S and waits[-1] == retry_after.MAX_S  # bounded both ways
    assert retry_after.retry_after_s(1200, tokens_per_s=100.0) == 12.0
    assert retry_after.retry_after_s(1200, tokens_per_s=50.0) == 24.0  # a slower engine: a longer wait
    assert retry_after.retry_after_s(1200, tokens_per_s=0.0) == retry_after.UNMEASURED_S


def test_only_the_work_of_equal_or_more_important_tiers_is_ahead() -> None:
    queue = {0: 100, 1: 1000, 2: 10_000}
    assert [retry_after.work_ahead(queue, p) for p in (0, 1, 2, 3)] == [100, 1100, 11_100, 11_100]


@pytest.fixture(scope="module")
def slow_engine() -> Iterator[Server]:
    """One sequence at a time, four waiting; a step delay caps the engine at 20 steps/s, so its
    throughput (one decode per step, plus a few prompt tokens) is at most ~21 tokens/s."""
    yield from start_server(
        "--driver", "native", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1",
        "--max-num-seqs", "1", "--max-waiting", "4", "--no-load-shedding", "--fault-step-delay", "node-0=0.05",
        "--drain-timeout", "1",  # requests still waiting at the end need not be drained
        startup_timeout_s=300,
    )


class Stream(threading.Thread):
    def __init__(self, server: Server, priority: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.priority, self.max_tokens = server, priority, max_tokens
        self.first_token = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "priority": self.priority}
        with httpx.stream("POST", f"{self.server.v1}/completions", json=body, timeout=HANG_S) as resp:
            for line in resp.iter_lines():
                if '"text"' in line:
                    self.first_token.set()
                if self.stop.is_set():
                    return  # closing the stream aborts the request


def test_a_refusal_says_how_long_the_work_ahead_of_it_takes(slow_engine: Server) -> None:
    running = Stream(slow_engine, priority=0, max_tokens=400)
    running.start()
    assert running.first_token.wait(HANG_S)
    # Ahead of a tier-0 request: one short tier-0 request (~22 tokens of work). Ahead of a tier-2 one:
    # that plus three long tier-2 requests (~1,200 tokens): over a minute at <= 21 tokens/s.
    waiting = [Stream(slow_engine, 0, 16)] + [Stream(slow_engine, 2, 400) for _ in range(3)]
    for s in waiting:
        s.start()
    try:
        deadline = time.monotonic() + HANG_S
        while (stats := slow_engine.stats())["waiting"] < 4 or not stats["generation_tokens_per_s"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)

        def refused(priority: int) -> float:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "priority": priority}
            resp = httpx.post(f"{slow_engine.v1}/completions", json=body, timeout=60)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "overloaded", resp.text
            return float(resp.headers["retry-after"])

        tier0, tier2 = refused(0), refused(2)
        # ~1,200 tokens of work ahead of tier 2 against ~22 ahead of tier 0, at the same throughput: how
        # many seconds that is depends on this machine, the order and the bounds do not.
        assert 1 <= tier0 < tier2 <= retry_after.MAX_S
    finally:
        for s in [running, *waiting]:
            s.stop.set()
