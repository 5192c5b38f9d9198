"""node_health with synthetic samples: spikes never flag, sustained slowness does, recovery unflags,
load is normalised, the watchdog sees stalls."""

from __future__ import annotations

import random

from observability.node_health import (
    EventKind,
    NodeHealthConfig,
    NodeHealthMonitor,
    NodeStatus,
    prompt_bucket,
)

NODES = ["node-0", "node-1", "node-2"]
CFG = NodeHealthConfig(window_s=20, min_samples=20, flag_after=3, unflag_after=3, stall_after_s=5)


def itl_for(batch: int, slow: float = 1.0) -> float:
    """A CPU engine's step time grows with the batch: 10 ms + 2 ms per sequence."""
    return (0.010 + 0.002 * batch) * slow


def feed(mon: NodeHealthMonitor, t0: float, seconds: int, plan: dict[str, tuple[list[int], float]],
         rng: random.Random) -> list:
    """Per second, 30 ITL samples per node at batches drawn from plan[node][0], scaled by plan[node][1]."""
    events = []
    for s in range(seconds):
        now = t0 + s
        for node, (batches, slow) in plan.items():
            for k in range(30):
                b = rng.choice(batches)
                mon.record_itl(node, now + k / 30, itl_for(b, slow) * rng.uniform(0.9, 1.1), b)
        events += mon.evaluate(now + 1)
    return events


def test_a_sustained_slow_node_is_flagged_alone_and_unflagged_after_recovery() -> None:
    rng = random.Random(0)
    mon = NodeHealthMonitor(NODES, CFG)
    normal = ([2, 3, 4, 6, 8], 1.0)
    events = feed(mon, 0, 10, dict.fromkeys(NODES, normal), rng)
    assert events == [] and all(mon.status(n) is NodeStatus.HEALTHY for n in NODES)
    events = feed(mon, 10, 15, {"node-0": normal, "node-1": ([2, 3, 4, 6, 8], 3.0), "node-2": normal}, rng)
    assert [(e.node, e.kind) for e in events] == [("node-1", EventKind.FLAGGED)]
    assert "itl" in events[0].reason
    assert mon.status("node-1") is NodeStatus.SLUGGISH
    events = feed(mon, 25, 30, dict.fromkeys(NODES, normal), rng)
    assert [(e.node, e.kind) for e in events] == [("node-1", EventKind.UNFLAGGED)]
    assert all(mon.status(n) is NodeStatus.HEALTHY for n in NODES)
    a = {x.node: x for x in mon.assessments()}
    assert a["node-1"].itl_p50_s is not None and a["node-1"].samples > 0


def test_a_spike_does_not_flag() -> None:
    rng = random.Random(1)
    mon = NodeHealthMonitor(NODES, CFG)
    normal = ([2, 4, 8], 1.0)
    feed(mon, 0, 10, dict.fromkeys(NODES, normal), rng)
    # one second of 10x latency on node-2, then normal again
    events = feed(mon, 10, 1, {"node-0": normal, "node-1": normal, "node-2": ([2, 4, 8], 10.0)}, rng)
    events += feed(mon, 11, 25, dict.fromkeys(NODES, normal), rng)
    assert events == []
    assert mon.status("node-2") is NodeStatus.HEALTHY


def test_a_node_slower_only_because_of_4x_the_batch_is_not_flagged() -> None:
    rng = random.Random(2)
    mon = NodeHealthMonitor(NODES, CFG)
    # node-0 runs 4x the batch of its peers: its raw ITL is ~2-3x theirs, on the same curve
    plan = {"node-0": ([8, 12, 16, 24, 32], 1.0), "node-1": ([2, 3, 4, 6, 8], 1.0),
            "node-2": ([2, 3, 4, 6, 8], 1.0)}
    events = feed(mon, 0, 15, plan, rng)
    assert events == []
    a = {x.node: x for x in mon.assessments()}
    assert a["node-0"].itl_p50_s > 2 * a["node-1"].itl_p50_s  # raw latency would have flagged it
    assert a["node-0"].score is not None and a["node-0"].score < 1.25
    # ...while a node that is slow at the same batch as its peers is flagged
    plan["node-2"] = ([2, 3, 4, 6, 8], 2.5)
    events = feed(mon, 15, 15, plan, rng)
    assert [(e.node, e.kind) for e in events] == [("node-2", EventKind.FLAGGED)]


def test_the_watchdog_flags_a_node_with_work_and_no_tokens_then_recovers() -> None:
    mon = NodeHealthMonitor(NODES, CFG)
    for n in NODES:
        mon.set_in_flight(n, 2, now=0)
    for t in range(8):
        for n in ("node-0", "node-2"):
            mon.record_itl(n, t + 0.5, 0.02, 2)
        events = mon.evaluate(t + 1)
        if t + 1 < 5:
            assert events == []
    assert mon.status("node-1") is NodeStatus.STALLED
    assert [(e.node, e.kind) for e in mon.events] == [("node-1", EventKind.STALLED)]
    assert "no token" in mon.events[0].reason
    mon.record_itl("node-1", 8.5, 0.02, 2)
    assert [(e.node, e.kind) for e in mon.evaluate(9)] == [("node-1", EventKind.RECOVERED)]
    # an idle node is never stalled
    mon.set_in_flight("node-0", 0, now=9)
    assert mon.evaluate(30) and mon.status("node-0") is NodeStatus.HEALTHY


def test_prompt_buckets() -> None:
    assert [prompt_bucket(n) for n in (1, 128, 129, 512, 2000, 8192, 9000)] == [
        "<=128", "<=128", "<=512", "<=512", "<=2k", "<=8k", ">8k"]


def test_a_dead_node_is_left_out_and_a_restarted_one_is_judged_afresh() -> None:
    rng = random.Random(3)
    mon = NodeHealthMonitor(NODES, CFG)
    normal = ([2, 4, 8], 1.0)
    feed(mon, 0, 10, {"node-0": normal, "node-1": ([2, 4, 8], 3.0), "node-2": normal}, rng)
    assert mon.status("node-1") is NodeStatus.SLUGGISH
    mon.mark_dead("node-1", "engine dead: killed; restarting in 1.0 s", 10.0)
    mon.mark_dead("node-1", "engine dead: killed; restarting in 2.0 s", 11.0)  # a new plan, not a new event
    assert [e.kind for e in mon.events if e.node == "node-1"] == [EventKind.FLAGGED, EventKind.FLAGGED]
    assert {a.node: a.reason for a in mon.assessments()}["node-1"].endswith("2.0 s")
    feed(mon, 11, 5, {"node-0": normal, "node-2": normal}, rng)
    assert mon.status("node-1") is NodeStatus.DEAD
    mon.mark_restarted("node-1", 16.0)
    assert mon.status("node-1") is NodeStatus.HEALTHY
    assert mon.events[-1].kind is EventKind.RESTARTED
    assert {a.node: a.samples for a in mon.assessments()}["node-1"] == 0  # the old process's samples are gone
    events = feed(mon, 16, 10, dict.fromkeys(NODES, normal), rng)  # the transitions come out of evaluate()
    assert [(e.node, e.kind) for e in events] == [("node-1", EventKind.RESTARTED)]
    assert mon.status("node-1") is NodeStatus.HEALTHY
