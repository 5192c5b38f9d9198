"""Scheduling under pressure, without a model: priority preemption and fair sharing between tenants."""

from __future__ import annotations

from test_scheduler import drain, make_request, make_scheduler, run_step, token_for

from engine_native.config import SchedulerConfig
from engine_native.kv_cache_manager import KVCacheManager
from engine_native.request import Request, RequestStatus
from engine_native.scheduler import Scheduler


def tenant_request(rid: str, tenant: str, n_prompt: int = 8, max_tokens: int = 8, priority: int = 0,
                   arrival: float = 0.0) -> Request:
    r = make_request(rid, n_prompt, max_tokens, priority=priority, arrival=arrival)
    r.tenant_id = tenant
    return r


def test_high_priority_arrival_preempts_at_a_full_running_cap() -> None:
    s = make_scheduler(num_blocks=256, max_num_seqs=2)
    low = [make_request(f"low{i}", 8, max_tokens=50, priority=2, arrival=float(i)) for i in range(2)]
    for r in low:
        s.add_request(r)
    run_step(s)
    assert len(s.running) == 2  # the cap is full; the pool is not
    vip = make_request("vip", 8, max_tokens=5, priority=0, arrival=10.0)
    s.add_request(vip)
    sched = run_step(s)
    assert "vip" in {x.request.request_id for x in sched.scheduled}
    assert sched.preempted_ids == ["low1"]  # the least important, most recent one
    assert low[1].status == RequestStatus.PREEMPTED and low[0].status == RequestStatus.RUNNING
    drain(s)
    for r in [*low, vip]:  # the preempted one resumes: nothing lost or repeated
        assert r.output_token_ids == [token_for(r, k) for k in range(r.sampling_params.max_tokens)]


def test_high_priority_arrival_preempts_when_the_pool_is_full() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=8)
    low = make_request("low", 16, max_tokens=8, priority=1)
    s.add_request(low)
    run_step(s)
    vip = make_request("vip", 12, max_tokens=4, priority=0, arrival=1.0)
    s.add_request(vip)
    sched = run_step(s)
    assert sched.preempted_ids == ["low"] and "vip" in {x.request.request_id for x in sched.scheduled}
    drain(s)
    assert low.output_token_ids == [token_for(low, k) for k in range(8)]


def test_equal_priority_never_preempts_to_get_in() -> None:
    s = make_scheduler(num_blocks=256, max_num_seqs=1)
    first = make_request("first", 8, max_tokens=20, priority=1)
    s.add_request(first)
    run_step(s)
    s.add_request(make_request("second", 8, max_tokens=5, priority=1, arrival=1.0))
    while first.num_output_tokens < 20:
        assert not run_step(s).preempted_ids
    drain(s)


def test_low_priority_is_not_starved_once_high_priority_drains() -> None:
    s = make_scheduler(num_blocks=512, max_num_seqs=2)
    lows = [make_request(f"low{i}", 8, 10, priority=2, arrival=float(i)) for i in range(3)]
    highs = [make_request(f"high{i}", 8, 10, priority=0, arrival=100.0 + i) for i in range(6)]
    for r in lows + highs:
        s.add_request(r)
    drain(s)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in lows + highs)
    assert max(r.finish_time or 0 for r in highs) <= min(r.finish_time or 0 for r in lows)


def _fair_scheduler(weights: dict[str, float]) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                             max_waiting=10_000, tenant_weights=weights)
    return Scheduler(config, KVCacheManager(4096, 16), max_model_len=4096)


def _flood_and_measure(weights: dict[str, float], steps: int = 1000) -> dict[str, int]:
    s = _fair_scheduler(weights)
    served: dict[str, int] = {t: 0 for t in weights}
    n = 0
    for step in range(steps):
        # Both tenants keep plenty of requests waiting; "a" floods with three times as many.
        for tenant, backlog in (("a", 30), ("b", 10)):
            while sum(1 for r in s.waiting if r.tenant_id == tenant) < backlog:
                s.add_request(tenant_request(f"{tenant}{n}", tenant, n_prompt=16, max_tokens=16, arrival=float(step)))
                n += 1
        sched = run_step(s)
        for x in sched.scheduled:
            served[x.request.tenant_id or ""] += x.num_new_tokens
    return served


def test_fair_share_between_two_flooding_tenants_of_equal_weight() -> None:
    served = _flood_and_measure({"a": 1.0, "b": 1.0})
    share_b = served["b"] / (served["a"] + served["b"])
    assert abs(share_b - 0.5) <= 0.05, served


def test_fair_share_follows_the_weights() -> None:
    served = _flood_and_measure({"a": 1.0, "b": 3.0})
    share_b = served["b"] / (served["a"] + served["b"])
    assert abs(share_b - 0.75) <= 0.075, served  # within 10% of its weight


def test_an_idle_tenant_banks_no_credit() -> None:
    s = _fair_scheduler({"a": 1.0, "b": 1.0})
    for i in range(40):
        s.add_request(tenant_request(f"a{i}", "a", arrival=float(i)))
    for _ in range(30):
        run_step(s)
    assert s.fair_share.counter("a") > 0
    # b arrives late: it is lifted to the waiting tenants' level, not left at zero to monopolise
    s.add_request(tenant_request("b0", "b", arrival=100.0))
    assert s.fair_share.counter("b") == s.fair_share.counter("a") > 0


def test_a_more_important_arrival_gets_its_first_chunk_in_a_step_of_its_own() -> None:
    s = make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    lows = [make_request(f"low{i}", 8, max_tokens=30, priority=2, arrival=float(i)) for i in range(3)]
    for r in lows:
        s.add_request(r)
    run_step(s)
    vip = make_request("vip", 40, max_tokens=3, priority=0, arrival=10.0)
    s.add_request(vip)
    first = run_step(s)
    assert [x.request.request_id for x in first.scheduled] == ["vip"] and not first.preempted_ids
    second = run_step(s)  # the rest of its prompt shares the step with everyone's decodes again
    assert {x.request.request_id for x in second.scheduled} == {"vip", "low0", "low1", "low2"}
    drain(s)
    for r in [*lows, vip]:
        assert r.output_token_ids == [token_for(r, k) for k in range(r.sampling_params.max_tokens)]


def test_equal_priority_arrivals_share_the_step() -> None:
    s = make_scheduler(num_blocks=512, max_num_seqs=8)
    s.add_request(make_request("a", 8, max_tokens=10, priority=1))
    run_step(s)
    s.add_request(make_request("b", 8, max_tokens=10, priority=1, arrival=1.0))
    assert {x.request.request_id for x in run_step(s).scheduled} == {"a", "b"}
