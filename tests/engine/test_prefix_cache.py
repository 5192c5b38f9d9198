"""Prefix caching in the KV cache manager and the scheduler, without a model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_scheduler import drain, run_step, token_for

from engine_native.config import SchedulerConfig
from engine_native.kv_cache_manager import KVCacheManager
from engine_native.request import Request, RequestStatus
from engine_native.sampling_params import SamplingParams
from engine_native.scheduler import Scheduler

BS = 4


def caching_scheduler(num_blocks: int = 64, share: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, share_prefix_across_tenants=share)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=64)
    return Scheduler(config, kv, max_model_len=4096)


def request(rid: str, prompt: list[int], max_tokens: int = 4, tenant: str | None = "t") -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), tenant_id=tenant,
                   eos_token_ids=frozenset({0}))


SYSTEM = list(range(100, 118))  # 18 tokens: 4 full blocks and 2 more


def test_a_second_request_reuses_the_shared_prefix_blocks() -> None:
    s = caching_scheduler()
    first = request("a", SYSTEM + [1, 2, 3])
    s.add_request(first)
    drain(s)
    second = request("b", SYSTEM + [7, 8])
    s.add_request(second)
    sched = run_step(s)
    (scheduled,) = sched.scheduled
    assert scheduled.num_computed_before == 16  # four full blocks came from the cache
    assert scheduled.num_new_tokens == len(second.prompt_token_ids) - 16
    assert s.kv_cache.prefix_hits == 16
    drain(s)
    assert second.output_token_ids == [token_for(second, k) for k in range(4)]
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_running_requests_share_blocks_with_counted_references() -> None:
    s = caching_scheduler()
    s.add_request(request("a", SYSTEM + [1], max_tokens=30))
    run_step(s)
    s.add_request(request("b", SYSTEM + [2], max_tokens=30))
    run_step(s)
    shared = s.kv_cache.block_table("a")[:4]
    assert s.kv_cache.block_table("b")[:4] == shared
    assert all(s.kv_cache.pool.ref_cnt[b] == 2 for b in shared)
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert all(s.kv_cache.pool.ref_cnt[b] == 1 for b in shared)
    s.kv_cache.check_integrity()
    drain(s)


def test_the_whole_prompt_cached_still_computes_its_last_token() -> None:
    s = caching_scheduler()
    prompt = list(range(200, 216))  # exactly 4 blocks
    s.add_request(request("a", prompt))
    drain(s)
    s.add_request(request("b", prompt))
    (scheduled,) = run_step(s).scheduled
    assert scheduled.num_computed_before == 12 and scheduled.num_new_tokens == 4 and scheduled.samples


def test_tenants_do_not_share_unless_configured() -> None:
    for share, expected in ((False, 0), (True, 16)):
        s = caching_scheduler(share=share)
        s.add_request(request("a", SYSTEM + [1], tenant="alice"))
        drain(s)
        s.add_request(request("b", SYSTEM + [1], tenant="bob"))
        (scheduled,) = run_step(s).scheduled
        assert scheduled.num_computed_before == expected


def test_unreferenced_cached_blocks_are_evicted_lru_when_space_is_needed() -> None:
    s = caching_scheduler(num_blocks=8)
    s.add_request(request("a", SYSTEM + [1], max_tokens=1))  # 19 tokens: 5 blocks, 4 of them cached
    drain(s)
    assert len(s.kv_cache.pool.cached) == 4 and s.kv_cache.num_free_blocks == 8
    s.add_request(request("big", list(range(500, 528)), max_tokens=1))  # 28 tokens: 7 blocks
    drain(s)
    s.kv_cache.check_integrity()
    # the big prompt needed evictable blocks: only what was not taken survives in the index
    s.add_request(request("c", SYSTEM + [1]))
    (scheduled,) = run_step(s).scheduled
    assert scheduled.num_computed_before < 16


def test_a_burst_sharing_a_prefix_computes_it_once() -> None:
    """Requests that arrive together with the same system prompt: the first computes it, the others
    wait for its blocks to be cached instead of computing them again."""
    s = caching_scheduler()
    a, b, c = (request(rid, SYSTEM + [k]) for rid, k in (("a", 1), ("b", 2), ("c", 3)))
    for r in (a, b, c):
        s.add_request(r)
    (first,) = run_step(s).scheduled
    assert first.request is a and first.num_new_tokens == 19 and s.num_prefix_waits == 1
    second = run_step(s).scheduled  # a decodes; b and c start from the 16 cached tokens
    assert {(x.request.request_id, x.num_computed_before, x.num_new_tokens) for x in second} == {
        ("a", 19, 1), ("b", 16, 3), ("c", 16, 3)}
    assert s.kv_cache.prefix_hits == 32
    drain(s)
    for r in (a, b, c):
        assert r.output_token_ids == [token_for(r, k) for k in range(4)]


def test_a_request_waiting_on_a_prefix_goes_on_when_its_computer_stops() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=8),
                  kv, max_model_len=4096)
    s.add_request(request("a", SYSTEM + [1]))
    s.add_request(request("b", SYSTEM + [2]))
    (first,) = run_step(s).scheduled  # a computes 8 of its 19 tokens; b waits for the rest of the prefix
    assert first.request.request_id == "a" and first.num_new_tokens == 8
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    (second,) = run_step(s).scheduled  # nobody computes the prefix now: b does, from what a cached
    assert (second.request.request_id, second.num_computed_before, second.num_new_tokens) == ("b", 8, 8)
    drain(s)


class PrefixMachine(RuleBasedStateMachine):
    """Random requests over a few shared prefixes, aborts and steps: the invariant always holds
    and every finished request has exactly the tokens it would have had alone."""

    def __init__(self) -> None:
        super().__init__()
        self.s = caching_scheduler(num_blocks=20)
        self.n = 0
        self.all: list[Request] = []

    @rule(prefix=st.integers(0, 2), extra=st.integers(1, 12), max_tokens=st.integers(1, 12),
          tenant=st.sampled_from(["x", "y"]))
    def add(self, prefix: int, extra: int, max_tokens: int, tenant: str) -> None:
        prompt = [1000 * (prefix + 1) + i for i in range(10)] + [7] * extra
        r = request(f"r{self.n}", prompt, max_tokens, tenant=tenant)
        self.n += 1
        try:
            self.s.add_request(r)
            self.all.append(r)
        except ValueError:
            pass

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        if self.s.requests:
            ids = sorted(self.s.requests)
            self.s.finish_request(ids[pick % len(ids)], RequestStatus.FINISHED_ABORTED)

    @rule()
    def step(self) -> None:
        run_step(self.s)

    @invariant()
    def consistent(self) -> None:
        self.s.kv_cache.check_integrity()

    def teardown(self) -> None:
        drain(self.s)
        assert self.s.kv_cache.num_free_blocks == self.s.kv_cache.num_blocks
        for r in self.all:
            if r.status == RequestStatus.FINISHED_LENGTH:
                assert r.output_token_ids == [token_for(r, k) for k in range(r.sampling_params.max_tokens)]


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_block_names_are_a_sha256_chain_the_same_in_every_process() -> None:
    """A cache hit reuses KV without comparing tokens: names must be collision-resistant (not Python's
    64-bit hash()) and, for a fleet router, computable in another process."""
    import hashlib
    import struct
    import subprocess
    import sys

    s = caching_scheduler()
    s.add_request(request("a", SYSTEM + [1, 2, 3], max_tokens=1, tenant="tenant-α"))
    drain(s)
    names = set(s.kv_cache.pool.cached)

    parent = hashlib.sha256(b"sluice-prefix-v1\0" + "tenant-α".encode()).digest()
    expected = []
    for start in range(0, 20, BS):  # 21 prompt tokens computed: 5 full blocks of 4
        parent = hashlib.sha256(parent + struct.pack("<4I", *(SYSTEM + [1, 2, 3])[start : start + BS])).digest()
        expected.append(parent)
    assert names == set(expected)

    code = (
        "from engine_native.block_hash import prefix_hashes; "
        f"print(','.join(h.hex() for h in prefix_hashes({SYSTEM + [1, 2, 3]}, {BS}, 'tenant-α')))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip().split(",") == [h.hex() for h in expected]
