"""Swap-to-host preemption on CPU, where a second CPU pool stands in for pinned host memory: a request
swapped out and back continues with the same greedy output, and no block of either pool leaks."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from pathlib import Path

import pytest
from tiny_models import load_tiny_llama, prompt

from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.engine import LLMEngine
from engine_native.kv_cache_manager import KVCacheManager
from engine_native.model.base import LoadedModel
from engine_native.request import Request, RequestStatus
from engine_native.sampling_params import SamplingParams
from engine_native.scheduler import RunnerOutput, Scheduler
from engine_native.swap import HostSwapSpace, PreemptionCost, SwapPolicy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt(n, seed) for n, seed in [(30, 1), (22, 2), (37, 3), (12, 4), (26, 5), (33, 6)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_tiny_llama(Path(tmp_path_factory.mktemp("tiny-llama")))


def _engine(tiny: LoadedModel, num_blocks: int, mode: str = "swap", swap_blocks: int = 0) -> LLMEngine:
    config = EngineConfig(
        model_path="tiny", dtype="float32", device="cpu",
        cache=CacheConfig(block_size=8, num_blocks=num_blocks, preemption_mode=mode, swap_num_blocks=swap_blocks,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=512),
    )
    return LLMEngine(config, loaded=tiny)


def _run_checked(engine: LLMEngine) -> list[list[int]]:
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, p, GREEDY)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        engine.kv_cache.check_integrity()
        if engine.scheduler.swap is not None:
            engine.scheduler.swap.space.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    swap = engine.scheduler.swap
    if swap is not None:
        swap.space.end_step()
        assert swap.space.num_free == swap.space.num_blocks, "a host block leaked"
    return [got[rid] for rid in ids]


@pytest.fixture(scope="module")
def expected(tiny: LoadedModel) -> list[list[int]]:
    roomy = _engine(tiny, num_blocks=256)
    out = _run_checked(roomy)
    assert roomy.scheduler.num_preemptions == 0
    return out


def _tight_pool() -> int:
    # Every prompt fits at admission, but not the growth of all of them while decoding.
    return sum(-(-len(p) // 8) for p in PROMPTS) + 2


def test_swapped_requests_continue_with_identical_greedy_output(tiny: LoadedModel, expected: list[list[int]]) -> None:
    engine = _engine(tiny, _tight_pool(), mode="swap", swap_blocks=256)
    assert _run_checked(engine) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_swaps == engine.scheduler.num_preemptions  # room for all: every one swapped


def test_a_small_host_pool_swaps_some_and_recomputes_the_rest(tiny: LoadedModel, expected: list[list[int]]) -> None:
    engine = _engine(tiny, _tight_pool(), mode="swap", swap_blocks=8)
    assert _run_checked(engine) == expected
    assert 0 < engine.scheduler.num_swaps < engine.scheduler.num_preemptions


def test_recompute_mode_never_swaps_and_auto_asks_the_cost_estimate() -> None:
    space = HostSwapSpace(64)
    assert not SwapPolicy(space, "recompute").should_swap(1000, 10)
    assert SwapPolicy(space, "swap").should_swap(1000, 10)
    assert not SwapPolicy(space, "swap").should_swap(1000, 65)  # no room: recompute
    # An 8B model with GQA on a GPU: recomputing costs more than copying beyond a handful of tokens.
    cost = PreemptionCost(params=8 * 10**9, num_layers=32, hidden_size=4096, kv_bytes_per_token=131072,
                          flops_per_s=2e14, copy_bytes_per_s=2e10, fixed_s=2e-4)
    auto = SwapPolicy(space, "auto", cost)
    assert not auto.should_swap(1, 1) and auto.should_swap(512, 32)
    with pytest.raises(ValueError):
        SwapPolicy(space, "sometimes")


def _request(rid: str, n: int, priority: int = 0) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=4, ignore_eos=True), priority=priority)


def test_aborting_a_swapped_request_frees_its_host_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    space = HostSwapSpace(16)
    s = Scheduler(SchedulerConfig(max_num_seqs=4), kv, max_model_len=128, swap=SwapPolicy(space, "swap"))
    low, vip = _request("low", 20, priority=1), _request("vip", 20, priority=0)
    s.add_request(low)
    first = s.schedule()
    s.update_from_output(first, RunnerOutput(sampled_token_ids={"low": 1}))
    s.add_request(vip)
    second = s.schedule()  # vip needs the pool: low is swapped out, its 5 computed blocks' copies recorded
    assert second.preempted_ids == ["low"] and len(second.swap_out) == 5 and space.holds("low")
    assert low.num_computed_tokens == 20 and low.status == RequestStatus.PREEMPTED
    s.finish_request("low", RequestStatus.FINISHED_ABORTED)
    space.end_step()
    space.check_integrity()
    assert space.num_free == 16 and not space.holds("low")
