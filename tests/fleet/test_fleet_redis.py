"""Redis membership with real processes: a private redis-server, `sluice worker --redis` processes and
two gateway replicas that share nothing but Redis. Two replicas route a prefix to the same worker;
a new worker joins and gets traffic; SIGTERM drains one without a failed request; a killed one
leaves every view by its TTL; a restarted worker id fences its zombie."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from fleet_processes import (
    Stream,
    WorkerProcess,
    gateway,
    node_state,
    nodes,
    private_redis,
    wait_for,
    workers,
)

FAST = ["--driver", "synthetic", "--synthetic-tokens-per-second", "200", "--synthetic-ttft-ms", "5"]


@dataclass
class Fleet:
    redis_url: str
    gateways: list[str]
    workers: list[WorkerProcess]

    def worker(self, worker_id: str, *options: str) -> WorkerProcess:
        return WorkerProcess(worker_id, [*FAST, "--redis", self.redis_url, *options])


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with private_redis() as url, workers(2, *FAST, "--redis", url, prefix="r") as ws, \
            gateway("--fleet-redis", url) as a, gateway("--fleet-redis", url) as b:
        for base in (a, b):
            wait_for("both workers in the view", lambda base=base: len(nodes(base)) == 2)
        yield Fleet(url, [a, b], ws)


def complete(base: str, prompt: str, max_tokens: int = 4) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"model": "synthetic", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def system_prompt(tenant: int) -> str:
    return " ".join(f"rule{tenant}x{i}" for i in range(80))  # 80 words: five 16-token blocks


def test_two_gateways_route_a_prefix_to_the_same_worker(fleet: Fleet) -> None:
    homes = set()
    for tenant in range(8):
        before = {w.worker_id: w.served() for w in fleet.workers}
        for i in range(2):
            for base in fleet.gateways:
                complete(base, f"{system_prompt(tenant)} question {i} from {base}")
        grew = {w.worker_id: w.served() - before[w.worker_id] for w in fleet.workers}
        assert sorted(grew.values()) == [0, 4], grew  # all four on one worker, from both gateways
        homes.add(max(grew, key=lambda k: grew[k]))
    assert homes == {"r0", "r1"}  # and the prefixes do not all land on one worker


def test_a_new_worker_joins_gets_traffic_and_drains_on_sigterm(fleet: Fleet) -> None:
    base = fleet.gateways[0]
    new = fleet.worker("joiner", "--synthetic-tokens-per-second", "50")  # its streams outlast the SIGTERM
    try:
        # Ready, not only present: a worker enters the views joining (not routable) and a gateway sees it ready at
        # its next look; on a fast host the twelve requests below can be over before that (none on the joiner).
        for g in fleet.gateways:
            wait_for("the new worker ready in the view", lambda g=g: node_state(g, "joiner") == "ready", 10)
        for i in range(12):
            complete(base, f"{system_prompt(100 + i)} hello")
        assert new.served() > 0
        # Under load: long streams, some on the joiner; SIGTERM drains it, nothing fails.
        # Nine tenants: where each lands depends on heartbeats' lag (bounded load), so a few more than
        # the workers make sure the joiner holds some; 200 tokens at 50/s keep them open 4 s.
        streams = [Stream(base, {"model": "synthetic", "prompt": f"{system_prompt(100 + i)} go", "max_tokens": 200,
                                 "temperature": 0}).start() for i in range(9)]
        wait_for("streams open on the joiner",
                 lambda: any(n["id"] == "joiner" and n["in_flight"] for n in nodes(base)), 10)
        for s in streams:
            assert s.started.wait(60)
        new.signal(signal.SIGTERM)
        wait_for("draining in both views",
                 lambda: all(node_state(g, "joiner") == "draining" for g in fleet.gateways), 10)
        complete(base, f"{system_prompt(100)} after the drain began")  # routed elsewhere, succeeds
        for s in streams:
            s.join()
            assert s.error is None and s.finish_reason == "length" and s.completion_tokens == 200
        assert new.process.wait(30) == 0
        for g in fleet.gateways:
            wait_for("the drained worker out of the view", lambda g=g: "joiner" not in {n["id"] for n in nodes(g)}, 10)
    finally:
        new.stop()


def test_a_killed_worker_leaves_every_view(fleet: Fleet) -> None:
    doomed = fleet.worker("doomed")
    try:
        for g in fleet.gateways:
            wait_for("joined", lambda g=g: "doomed" in {n["id"] for n in nodes(g)}, 10)
        doomed.signal(signal.SIGKILL)
        for g in fleet.gateways:  # TTL 2.5 s + a 0.5 s rescan; the deadline only catches a view that never learns
            wait_for("the killed worker out of the view", lambda g=g: "doomed" not in {n["id"] for n in nodes(g)}, 15)
        complete(fleet.gateways[0], "still served")
    finally:
        doomed.stop()


def test_a_restarted_worker_fences_its_zombie(fleet: Fleet) -> None:
    old = fleet.worker("twin")
    try:
        base = fleet.gateways[1]
        first = wait_for("twin in the view", lambda: {n["id"]: n for n in nodes(base)}.get("twin"), 10)
        new = fleet.worker("twin")  # the same id again: a restart while the old process still runs
        try:
            def newer() -> dict[str, object] | None:
                n = {n["id"]: n for n in nodes(base)}.get("twin")
                return n if n and n["address"] == new.url else None

            second = wait_for("the new incarnation in the view", newer, 10)
            assert int(str(second["incarnation"])) > int(str(first["incarnation"]))
            wait_for("the zombie fenced", lambda: "fenced" in old.log_tail(), 10)
            assert newer() is not None  # the zombie never wrote over its successor
        finally:
            new.stop()
    finally:
        old.stop()
