"""Three real engine processes (bundled SmolLM2, 1 thread each) under load: a step delay injected
into one node flags that node, and only it, and the flag lifts once the delay is removed; a stalled
node (requests kept, no steps) is flagged by the watchdog.

Nothing here is timed: each step waits for a state the previous one causes, with a deadline that
only catches a hang (the figures are printed, not asserted; the thresholds themselves are tested
with injected clocks in test_node_health.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Self

import httpx
import pytest
from gateway_server import Server, start_server

MODEL = "smollm2-135m-instruct"
HANG_S = 240.0  # a deadline that only catches a hang on a busy 2-core box


@pytest.fixture(scope="module")
def nodes3() -> Iterator[Server]:
    yield from start_server(
        "--driver", "native", "--engines", "3", "--num-threads", "1", "--max-model-len", "512",
        "--kv-cache-memory", "32MiB", "--max-num-seqs", "8",
        # thresholds for a shared 2-core CI box: a big injected delay, a clear ratio, a short window
        "--node-window", "8", "--node-min-samples", "10", "--node-min-ratio", "2.5",
        "--node-flag-after", "3", "--node-unflag-after", "3", "--node-stall-after", "3",
        startup_timeout_s=240,
    )


class Load:
    """`streams` clients sending short completions back to back until stopped."""

    def __init__(self, server: Server, streams: int = 6) -> None:
        self.stop = threading.Event()
        self.served = 0
        self.threads = [threading.Thread(target=self._run, args=(server, i), daemon=True) for i in range(streams)]

    def _run(self, server: Server, i: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                try:
                    client.post(f"{server.v1}/completions", json={
                        "model": MODEL, "prompt": f"Count slowly from {i} to fifty:", "max_tokens": 16,
                        "ignore_eos": True, "temperature": 0})
                    self.served += 1
                except httpx.HTTPError:
                    time.sleep(0.2)

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def _nodes(server: Server) -> dict[str, dict[str, object]]:
    report = httpx.get(f"{server.base_url}/admin/nodes", timeout=10).json()
    return {n["id"]: n for n in report["nodes"]}


def _fault(server: Server, node: str, delay: float = 0.0, stall: bool = False) -> None:
    r = httpx.post(f"{server.base_url}/admin/nodes/{node}/fault", json={"step_delay_s": delay, "stall": stall})
    assert r.status_code == 200, r.text


def _wait(server: Server, until: Callable[[dict[str, dict[str, object]]], bool],
          never: Callable[[dict[str, dict[str, object]]], bool] = lambda _: False, timeout_s: float = HANG_S) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        nodes = _nodes(server)
        assert not never(nodes), nodes
        if until(nodes):
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"not reached in {timeout_s} s: {_nodes(server)}")


def _others_healthy(node: str) -> Callable[[dict[str, dict[str, object]]], bool]:
    return lambda nodes: any(n["status"] != "healthy" for i, n in nodes.items() if i != node)


def test_a_slow_node_is_flagged_alone_then_unflagged_and_a_stalled_node_is_caught(nodes3: Server) -> None:
    with Load(nodes3):
        # Every node judged on a window of normal samples (a score needs enough of them and peers).
        _wait(nodes3, lambda n: all(x["score"] is not None for x in n.values()))
        assert all(n["status"] == "healthy" for n in _nodes(nodes3).values())
        _fault(nodes3, "node-1", delay=0.5)
        took = _wait(nodes3, lambda n: n["node-1"]["status"] == "sluggish", never=_others_healthy("node-1"))
        flagged = _nodes(nodes3)["node-1"]
        assert flagged["reason"] and flagged["itl_p99_ms"] >= 500  # a sample of a step with the 0.5 s sleep
        _fault(nodes3, "node-1", delay=0.0)
        back = _wait(nodes3, lambda n: n["node-1"]["status"] == "healthy", never=_others_healthy("node-1"))
        _fault(nodes3, "node-2", stall=True)
        stalled = _wait(nodes3, lambda n: n["node-2"]["status"] == "stalled")
        _fault(nodes3, "node-2", stall=False)
        _wait(nodes3, lambda n: n["node-2"]["status"] != "stalled")
    report = httpx.get(f"{nodes3.base_url}/admin/nodes").json()
    kinds = [(e["node"], e["kind"]) for e in report["events"]]
    assert kinds[:4] == [("node-1", "flagged"), ("node-1", "unflagged"), ("node-2", "stalled"),
                         ("node-2", "recovered")], kinds
    metrics = httpx.get(f"{nodes3.base_url}/metrics").text
    assert 'sluice_node_sluggish{node="node-1"} 0.0' in metrics
    print(f"flagged after {took:.1f} s, unflagged {back:.1f} s after the delay was removed, "
          f"stall caught after {stalled:.1f} s")
