"""A gateway (`--driver fleet`, static `--workers`) over real `sluice worker --driver synthetic`
processes: a worker killed with SIGKILL or frozen with SIGSTOP under concurrent streams, and a
worker drained with SIGTERM. Every stream must complete, with exactly the text an uninterrupted
single-node run gives (the synthetic engine's greedy output is a function of the context, like a
model's), so a repeated or missing token would show. Nothing is timed; deadlines catch hangs."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import httpx
import pytest
from fleet_processes import Stream, WorkerProcess, gateway, node_state, nodes, wait_for, workers

from drivers.base import GenerationRequest
from drivers.synthetic import SyntheticDriver

SLOW = ["--driver", "synthetic", "--synthetic-tokens-per-second", "40", "--synthetic-ttft-ms", "10"]
MAX_TOKENS = 60
STREAMS = 12


def reference(prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    """What one uninterrupted synthetic engine answers, in-process."""
    async def run() -> list[str]:
        driver = SyntheticDriver(tokens_per_second=0, ttft_s=0)
        await driver.start()
        out = []
        for i, p in enumerate(prompts):
            req = GenerationRequest(request_id=f"ref{i}", model="synthetic", prompt=p, max_tokens=max_tokens,
                                    temperature=0)
            out.append("".join([c.text async for c in driver.generate(req)]))
        return out
    return asyncio.run(run())


def prompts(n: int) -> list[str]:
    return [f"stream {i} tells the tale of number {i * 7}" for i in range(n)]


def run_streams(base_url: str, texts: list[str], max_tokens: int = MAX_TOKENS) -> list[Stream]:
    streams = [Stream(base_url, {"model": "synthetic", "prompt": p, "max_tokens": max_tokens, "temperature": 0}).start()
               for p in texts]
    for s in streams:
        assert s.started.wait(60)
    return streams


def check_all_complete(streams: list[Stream], expected: list[str], max_tokens: int = MAX_TOKENS) -> None:
    for s, want in zip(streams, expected, strict=True):
        s.join()
        assert s.error is None, s.error
        assert s.text == want  # no token repeated, none missing, none changed
        assert (s.finish_reason, s.completion_tokens) == ("length", max_tokens)


@contextlib.contextmanager
def fleet_of(count: int, *options: str) -> Iterator[tuple[str, list[WorkerProcess]]]:
    with workers(count, *SLOW) as ws, gateway("--workers", ",".join(w.url for w in ws), *options) as base:
        wait_for(f"{count} workers in the view", lambda: len(nodes(base)) == count)
        yield base, ws


@pytest.fixture(scope="module")
def fleet3() -> Iterator[tuple[str, list[WorkerProcess]]]:
    with fleet_of(3) as fleet:
        yield fleet


def by_id(ws: list[WorkerProcess], wid: str) -> WorkerProcess:
    return next(w for w in ws if w.worker_id == wid)


def test_fleet_serves_and_admin_lists_workers(fleet3: tuple[str, list[WorkerProcess]]) -> None:
    base, ws = fleet3
    r = httpx.post(f"{base}/v1/completions", json={"model": "synthetic", "prompt": prompts(1)[0], "max_tokens": 8,
                                                   "temperature": 0}, timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == reference(prompts(1), 8)[0]
    listed = {n["id"]: n for n in nodes(base)}
    assert set(listed) == {"w0", "w1", "w2"}
    for w in ws:
        n = listed[w.worker_id]
        assert (n["address"], n["state"], n["circuit"]) == (w.url, "ready", "closed")
        assert isinstance(n["incarnation"], int) and n["incarnation"] > 0
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "synthetic"


def test_unknown_model_and_bad_input_are_4xx(fleet3: tuple[str, list[WorkerProcess]]) -> None:
    base, _ = fleet3
    r = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    r = httpx.post(f"{base}/v1/completions", json={"model": "synthetic", "prompt": "x", "max_tokens": 100000})
    assert r.status_code == 400


def stop_busiest(base: str, ws: list[WorkerProcess], sig: int) -> WorkerProcess:
    """Signal the worker that has the most of this gateway's streams open (at least one)."""
    busy = max(nodes(base), key=lambda n: int(str(n["in_flight"])))
    assert int(str(busy["in_flight"])) > 0
    victim = by_id(ws, str(busy["id"]))
    victim.signal(sig)
    return victim


def test_hang_then_kill_9_mid_stream_every_stream_completes_identically() -> None:
    # The default 2 s stall timeout; 4 attempts, so that a CPU-starved (not hung) worker on a loaded test
    # host costs a retry, not the request.
    with fleet_of(3, "--fleet-policy", "least-loaded", "--fleet-max-attempts", "4") as (base, ws):
        texts = prompts(STREAMS)
        expected = reference(texts)
        # SIGSTOP: alive, connections open, but silent: only the stall timeout can tell.
        streams = run_streams(base, texts)
        frozen = stop_busiest(base, ws, signal.SIGSTOP)
        try:
            check_all_complete(streams, expected)
            wait_for("the frozen worker out of rotation", lambda: frozen.worker_id not in
                     {n["id"] for n in nodes(base) if n["circuit"] == "closed"}, 10)
            # SIGKILL of another one: its streams break, they resume on the last worker.
            streams = run_streams(base, texts)
            victim = stop_busiest(base, ws, signal.SIGKILL)
            check_all_complete(streams, expected)
            wait_for("the dead worker out of the view", lambda: victim.worker_id not in {n["id"] for n in nodes(base)})
        finally:
            frozen.signal(signal.SIGCONT)


def test_sigterm_drains_without_a_failed_request() -> None:
    with fleet_of(2, "--fleet-policy", "round-robin") as (base, ws):
        texts = prompts(6)
        expected = reference(texts)
        streams = run_streams(base, texts)
        leaving = ws[0]
        leaving.signal(signal.SIGTERM)
        wait_for("draining in the view", lambda: node_state(base, "w0") == "draining", 5)
        # New requests go to the other worker meanwhile; the drained one finishes what it has.
        late = run_streams(base, texts[:2], 10)
        check_all_complete(streams, expected)
        check_all_complete(late, reference(texts[:2], 10), 10)
        assert leaving.process.wait(30) == 0
        assert ws[1].served() >= 2 + 3
