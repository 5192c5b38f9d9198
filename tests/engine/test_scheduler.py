"""Scheduler and KV cache manager without a model: hand-made runner outputs drive the steps."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_native.config import SchedulerConfig
from engine_native.kv_cache_manager import KVCacheManager
from engine_native.request import Request, RequestStatus
from engine_native.sampling_params import SamplingParams
from engine_native.scheduler import QueueFullError, RunnerOutput, Scheduler, SchedulerOutput

EOS = 0


def token_for(request: Request, index: int) -> int:
    """The 'model': a token that depends only on the request and the output position."""
    return 1 + (hash((request.request_id, index)) % 1000)


def fake_run(sched: SchedulerOutput, eos_at: dict[str, int] | None = None) -> RunnerOutput:
    out = RunnerOutput()
    for s in sched.scheduled:
        if s.samples:
            idx = s.request.num_output_tokens
            eos = eos_at is not None and eos_at.get(s.request.request_id) == idx
            out.sampled_token_ids[s.request.request_id] = EOS if eos else token_for(s.request, idx)
    return out


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **cfg: float) -> Scheduler:
    config = SchedulerConfig(
        **{"max_num_seqs": 8, "max_num_batched_tokens": 32, "long_prefill_token_threshold": 16,
           "wave_budget_factor": 1, **cfg}
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len=4096)


def make_request(
    rid: str, n_prompt: int, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[5] * n_prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        priority=priority,
        arrival_time=arrival,
        eos_token_ids=frozenset({EOS}),
    )


def run_step(s: Scheduler, eos_at: dict[str, int] | None = None) -> SchedulerOutput:
    sched = s.schedule()
    s.update_from_output(sched, fake_run(sched, eos_at))
    s.kv_cache.check_integrity()
    return sched


def drain(s: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while s.has_work:
        run_step(s)
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    return steps


# ----- KV cache manager --------------------------------------------------------------------


def test_allocate_is_all_or_nothing_and_free_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 9) == [0, 1, 2]  # 9 tokens -> 3 blocks
    assert kv.allocate_slots("a", 12) == []  # still fits in 3 blocks
    assert kv.allocate_slots("b", 8) is None  # needs 2, one is free: nothing taken
    assert kv.num_free_blocks == 1
    kv.check_integrity()
    kv.free("a")
    kv.free("a")  # idempotent
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_integrity_check_catches_a_block_owned_twice() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 4)
    kv._tables["b"] = list(kv._tables["a"])  # corrupt: b claims a's block without a ref
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_integrity_check_catches_a_leaked_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 4)
    del kv._tables["a"]  # forgotten without releasing
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity()


# ----- scheduling --------------------------------------------------------------------------


def test_requests_finish_with_exact_lengths_and_free_their_blocks() -> None:
    s = make_scheduler()
    reqs = [make_request(f"r{i}", n_prompt=3 + 7 * i, max_tokens=5 + i) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    drain(s)
    for i, r in enumerate(reqs):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [token_for(r, k) for k in range(5 + i)]
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_eos_stops_a_request() -> None:
    s = make_scheduler()
    r = make_request("r", 4, max_tokens=50)
    s.add_request(r)
    while s.has_work:
        run_step(s, eos_at={"r": 3})
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_output_tokens == 4 and r.output_token_ids[-1] == EOS


def test_long_prompt_is_chunked_and_never_stalls_running_decodes() -> None:
    s = make_scheduler(num_blocks=2048, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    decoders = [make_request(f"d{i}", 4, max_tokens=200) for i in range(4)]
    for r in decoders:
        s.add_request(r)
    run_step(s)  # decoders prefill together
    long = make_request("long", 4000, max_tokens=2, arrival=1.0)
    s.add_request(long)
    steps_with_prefill = 0
    while long.num_output_tokens == 0:
        sched = run_step(s)
        ids = {x.request.request_id: x.num_new_tokens for x in sched.scheduled}
        # every decoder decodes in every step while the long prompt is being prefilled
        assert all(ids.get(r.request_id) == 1 for r in decoders)
        assert ids.get("long", 0) <= 32
        steps_with_prefill += 1
    assert steps_with_prefill >= 4000 // 32
    assert long.num_prefill_chunks == steps_with_prefill - 1  # the last chunk samples


def test_prompt_work_beside_decodes_is_capped_and_a_step_without_decodes_takes_the_budget() -> None:
    s = make_scheduler(num_blocks=2048, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                       prefill_tokens_beside_decodes=8, prefill_backlog_steps=8)  # 40 tokens of backlog: 5 < 8
    first = [make_request(f"a{i}", 20, max_tokens=50) for i in range(3)]
    for r in first:
        s.add_request(r)
    sched = run_step(s)  # nobody decodes yet: the whole budget goes to prompts
    assert sum(x.num_new_tokens for x in sched.scheduled) == 60
    late = [make_request("b0", 20, max_tokens=50, arrival=1.0)]  # 3 decoders, 1 prompt: capped
    for r in late:
        s.add_request(r)
    while any(r.num_output_tokens == 0 for r in late):
        sched = run_step(s)
        new = {x.request.request_id: x.num_new_tokens for x in sched.scheduled}
        assert all(new[r.request_id] == 1 for r in first)  # every decode in every step
        prompt_work = [x for x in sched.scheduled if x.num_computed_before < x.request.num_prompt_tokens]
        assert 0 < sum(x.num_new_tokens for x in prompt_work) <= 8
    assert all(r.num_prefill_chunks >= 2 for r in late)
    drain(s)
    for r in first + late:
        assert r.output_token_ids == [token_for(r, k) for k in range(50)]


def test_a_backlog_of_prompts_lifts_the_cap_to_a_share_of_itself() -> None:
    # Prompts arriving faster than the cap computes them: the allowance is a quarter of what is still
    # to compute (never under the cap, never over the budget), so the backlog drains.
    s = make_scheduler(num_blocks=2048, max_num_seqs=20, max_num_batched_tokens=64,
                       long_prefill_token_threshold=64, prefill_tokens_beside_decodes=8, prefill_backlog_steps=4)
    first = [make_request(f"a{i}", 5, max_tokens=60) for i in range(12)]  # 12 decoders: more than 2 x 5 prompts
    for r in first:
        s.add_request(r)
    run_step(s)
    late = [make_request(f"b{i}", 40, max_tokens=60, arrival=1.0) for i in range(5)]
    for r in late:
        s.add_request(r)
    allowances = []
    while any(r.num_output_tokens == 0 for r in late):
        sched = run_step(s)
        assert all(x.num_new_tokens == 1 for x in sched.scheduled if x.request in first)  # decodes every step
        allowances.append(sum(x.num_new_tokens for x in sched.scheduled
                              if x.num_computed_before < x.request.num_prompt_tokens))
    assert allowances[0] == 200 // 4  # 5 prompts of 40 waiting: 50 of the 52 tokens left beside 12 decodes
    assert allowances == sorted(allowances, reverse=True)  # a share of a shrinking backlog
    assert allowances[1] < 50 and allowances[-1] <= 8  # down to the cap as the backlog drains
    drain(s)
    for r in first + late:
        assert r.output_token_ids == [token_for(r, k) for k in range(60)]


def test_the_cap_holds_only_where_more_streams_decode_than_prompts_wait() -> None:
    """Prompt work computed now stalls every decoder; put off, it delays every prompt waiting. The second
    half of a wave (fewer decoders than prompts) takes the budget and ends in one step; once decoders
    outnumber the prompts more than twice, the cap holds."""
    s = make_scheduler(num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=64,
                       long_prefill_token_threshold=64, prefill_tokens_beside_decodes=8)
    first = [make_request(f"a{i}", 8, max_tokens=40) for i in range(3)]
    for r in first:
        s.add_request(r)
    run_step(s)  # three decoders
    wave = [make_request(f"w{i}", 12, max_tokens=40, arrival=1.0) for i in range(4)]
    for r in wave:
        s.add_request(r)
    sched = run_step(s)  # 3 decoders, 4 prompts: no cap
    assert sum(x.num_new_tokens for x in sched.scheduled if x.request in wave) == 48
    assert all(r.num_output_tokens == 1 for r in wave)
    late = [make_request(f"b{i}", 12, max_tokens=40, arrival=2.0) for i in range(2)]
    for r in late:
        s.add_request(r)
    sched = run_step(s)  # 7 decoders, 2 prompts: capped
    assert sum(x.num_new_tokens for x in sched.scheduled if x.request in late) == 8
    drain(s)
    for r in first + wave + late:
        assert r.output_token_ids == [token_for(r, k) for k in range(40)]


def test_the_rest_of_a_wave_takes_the_budget_while_prompts_are_at_least_half_the_decoders() -> None:
    """A wave of 8 prompts meets an 80-token budget: 5 start, and the 3 left (48 tokens) are computed in the
    next step whole, beside the 5 new decoders, not cut by the cap into more steps (each a group of streams
    that will later be replaced beside the others' decodes). 2 prompts arriving beside 8 decoders are capped."""
    s = make_scheduler(num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=80,
                       long_prefill_token_threshold=80, prefill_tokens_beside_decodes=8)
    wave = [make_request(f"w{i}", 16, max_tokens=40) for i in range(8)]
    for r in wave:
        s.add_request(r)
    run_step(s)
    assert sum(r.num_output_tokens == 1 for r in wave) == 5
    sched = run_step(s)  # 5 decoders, 3 prompts: no cap
    assert sum(x.num_new_tokens for x in sched.scheduled if x.request in wave[5:]) == 48
    assert all(r.num_output_tokens >= 1 for r in wave)
    late = [make_request(f"b{i}", 16, max_tokens=40, arrival=1.0) for i in range(2)]
    for r in late:
        s.add_request(r)
    sched = run_step(s)  # 8 decoders, 2 prompts: capped
    assert sum(x.num_new_tokens for x in sched.scheduled if x.request in late) == 8
    drain(s)
    for r in wave + late:
        assert r.output_token_ids == [token_for(r, k) for k in range(40)]


def test_a_wave_reaching_an_engine_with_at_most_one_decode_takes_the_wave_budget() -> None:
    """The burst pattern of a closed loop at 32 streams: one prompt arrives first and is computed alone,
    the other 31 arrive during that step. At most one stream decodes, so the step may take twice the
    budget and the 31 start together; with two decoding streams the plain budget holds again."""
    s = make_scheduler(num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
                       long_prefill_token_threshold=256, wave_budget_factor=2)
    first = make_request("first", 128, max_tokens=20)
    s.add_request(first)
    run_step(s)  # alone: it decodes from now on
    wave = [make_request(f"w{i}", 128, max_tokens=20, arrival=1.0) for i in range(31)]
    for r in wave:
        s.add_request(r)
    sched = run_step(s)
    assert sched.num_batched_tokens == 1 + 31 * 128 > 2048
    assert all(r.num_output_tokens == 1 for r in wave)  # every first token from one step
    later = [make_request(f"l{i}", 128, max_tokens=20, arrival=2.0) for i in range(31)]
    for r in later:
        s.add_request(r)
    assert run_step(s).num_batched_tokens <= 2048  # 32 streams decode: the plain budget
    off = make_scheduler(num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
                         long_prefill_token_threshold=256, wave_budget_factor=1)
    off.add_request(make_request("first", 128, max_tokens=20))
    run_step(off)
    for i in range(31):
        off.add_request(make_request(f"w{i}", 128, max_tokens=20, arrival=1.0))
    assert run_step(off).num_batched_tokens <= 2048
    drain(s)
    for r in [first, *wave, *later]:
        assert r.output_token_ids == [token_for(r, k) for k in range(20)]


def test_preemption_by_recompute_keeps_outputs_exact() -> None:
    # 10 blocks x 4 tokens: 4 requests of 8 prompt + 12 output tokens (5 blocks each) cannot all fit.
    s = make_scheduler(num_blocks=10, block_size=4)
    reqs = [make_request(f"r{i}", 8, max_tokens=12, arrival=float(i)) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    drain(s)
    assert s.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == [token_for(r, k) for k in range(12)]  # none lost or repeated
    assert s.kv_cache.num_free_blocks == 10


def test_the_latest_arrival_is_preempted_first_and_priority_protects() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    important = make_request("important", 8, max_tokens=8, priority=0, arrival=2.0)
    early_low = make_request("early_low", 8, max_tokens=8, priority=1, arrival=0.0)
    late_low = make_request("late_low", 4, max_tokens=8, priority=1, arrival=1.0)
    for r in (important, early_low, late_low):
        s.add_request(r)
    preempted: list[str] = []
    while s.has_work:
        preempted.extend(run_step(s).preempted_ids)
    assert preempted and "important" not in preempted
    assert preempted[0] == "late_low"
    assert important.num_preemptions == 0


def test_waiting_queue_is_fcfs_within_priority() -> None:
    s = make_scheduler(max_num_seqs=1)
    order = [
        make_request("b", 4, 1, priority=1, arrival=0.0),
        make_request("a2", 4, 1, priority=0, arrival=2.0),
        make_request("a1", 4, 1, priority=0, arrival=1.0),
    ]
    for r in order:
        s.add_request(r)
    assert started_order(s) == ["a1", "a2", "b"]


def started_order(s: Scheduler) -> list[str]:
    """Run to the end; the ids in the order their first prompt chunk was computed."""
    started = []
    while s.has_work:
        sched = run_step(s)
        started.extend(x.request.request_id for x in sched.scheduled if x.num_computed_before == 0)
    return started


def test_a_burst_goes_shortest_prompt_first() -> None:
    s = make_scheduler(max_num_seqs=1)  # one at a time: the queue's order is the start order
    for rid, n in (("long", 12), ("short", 4), ("mid", 8)):
        s.add_request(make_request(rid, n, 1, arrival=5.0))
    assert started_order(s) == ["short", "mid", "long"]


def test_a_shorter_prompt_overtakes_only_within_its_window() -> None:
    # 1 ms a token: a 12-token prompt stands at arrival + 12 ms, a 4-token one at arrival + 4 ms; the short
    # one goes first if it came less than 8 ms after the long one.
    s = make_scheduler(max_num_seqs=1, prompt_order_ms_per_token=1.0)
    s.add_request(make_request("long", 12, 1, arrival=10.000))
    s.add_request(make_request("short_soon", 4, 1, arrival=10.007))
    s.add_request(make_request("short_late", 4, 1, arrival=10.009))
    assert started_order(s) == ["short_soon", "long", "short_late"]


def test_zero_ms_a_token_is_arrival_order_whatever_the_lengths() -> None:
    s = make_scheduler(max_num_seqs=1, prompt_order_ms_per_token=0.0)
    for i, n in enumerate((12, 4, 8)):
        s.add_request(make_request(f"r{i}", n, 1, arrival=5.0 + i * 1e-6))
    assert started_order(s) == ["r0", "r1", "r2"]


def test_the_default_order_follows_the_device_and_a_bad_one_is_refused() -> None:
    kv = KVCacheManager(16, 4)
    assert Scheduler(SchedulerConfig(), kv, 4096).waiting.order_s_per_token == pytest.approx(1e-3)
    assert Scheduler(SchedulerConfig(), kv, 4096, device_type="cuda").waiting.order_s_per_token == pytest.approx(1e-4)
    chosen = SchedulerConfig(prompt_order_ms_per_token=0.5)
    assert Scheduler(chosen, kv, 4096, device_type="cuda").waiting.order_s_per_token == pytest.approx(5e-4)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="prompt_order_ms_per_token"):
            Scheduler(SchedulerConfig(prompt_order_ms_per_token=bad), kv, 4096)


def test_a_preempted_request_keeps_its_place_in_line() -> None:
    # The long prompt runs first (alone in the queue), is preempted by a more important arrival, and
    # comes back ahead of a shorter one of its priority that arrived much later.
    s = make_scheduler(max_num_seqs=1, prompt_order_ms_per_token=1.0)
    s.add_request(make_request("long", 12, 4, priority=1, arrival=0.0))
    run_step(s)
    s.add_request(make_request("urgent", 4, 1, priority=0, arrival=1.0))
    s.add_request(make_request("short_later", 4, 1, priority=1, arrival=1.0))
    assert [x.request.request_id for x in run_step(s).scheduled] == ["urgent"]
    assert s.requests["long"].num_preemptions == 1
    assert started_order(s) == ["long", "short_later"]


def test_running_cap_and_queue_bound() -> None:
    s = make_scheduler(max_num_seqs=3, max_waiting=5)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4, 4))
    with pytest.raises(QueueFullError):
        s.add_request(make_request("one-too-many", 4, 4))
    sched = run_step(s)
    assert len(sched.scheduled) == 3 and len(s.running) == 3


def test_requests_that_can_never_fit_are_refused() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("huge", 10, max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("empty", 0))


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 20, 50), make_request("wait", 20, 50, arrival=1.0)
    s.add_request(running)
    s.add_request(waiting)
    run_step(s)
    assert s.kv_cache.num_free_blocks < s.kv_cache.num_blocks
    s.finish_request("run", RequestStatus.FINISHED_ABORTED)
    s.finish_request("wait", RequestStatus.FINISHED_ABORTED)
    s.kv_cache.check_integrity()
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks and not s.has_work


# ----- property-based: any interleaving keeps the invariant ---------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = make_scheduler(
            num_blocks=24,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            long_prefill_token_threshold=8,
        )
        self.n = 0
        self.all: list[Request] = []

    @rule(n_prompt=st.integers(1, 40), max_tokens=st.integers(1, 30), priority=st.integers(0, 2))
    def add(self, n_prompt: int, max_tokens: int, priority: int) -> None:
        r = make_request(f"r{self.n}", n_prompt, max_tokens, priority=priority, arrival=float(self.n))
        self.n += 1
        try:
            self.s.add_request(r)
            self.all.append(r)
        except ValueError:
            pass

    @precondition(lambda self: bool(self.s.requests))
    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick: int) -> None:
        ids = sorted(self.s.requests)
        self.s.finish_request(ids[pick % len(ids)], RequestStatus.FINISHED_ABORTED)

    @rule()
    def step(self) -> None:
        run_step(self.s)

    @invariant()
    def blocks_are_consistent(self) -> None:
        self.s.kv_cache.check_integrity()
        for r in self.s.running:
            assert len(self.s.kv_cache.block_table(r.request_id)) * 4 >= r.num_computed_tokens

    def teardown(self) -> None:
        drain(self.s)
        assert self.s.kv_cache.num_free_blocks == self.s.kv_cache.num_blocks
        for r in self.all:
            if r.status == RequestStatus.FINISHED_LENGTH:
                assert r.output_token_ids == [token_for(r, k) for k in range(r.sampling_params.max_tokens)]


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
