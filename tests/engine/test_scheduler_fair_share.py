"""Fair share between tenants, without a model: weights come with the requests (the tenant's record,
through the gateway), the config overrides them, and tokens recomputed after a preemption are not
charged to the tenant a second time."""

from __future__ import annotations

from test_scheduler import drain, make_request, run_step

from engine_native.config import SchedulerConfig
from engine_native.kv_cache_manager import KVCacheManager
from engine_native.request import Request
from engine_native.scheduler import Scheduler


def weighted_request(rid: str, tenant: str, weight: float = 1.0, n_prompt: int = 16, max_tokens: int = 16,
                     arrival: float = 0.0) -> Request:
    r = make_request(rid, n_prompt, max_tokens, arrival=arrival)
    r.tenant_id, r.tenant_weight = tenant, weight
    return r


def fair_scheduler(overrides: dict[str, float] | None = None, num_blocks: int = 4096, block_size: int = 16,
                   prefix_caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                             max_waiting=10_000, tenant_weights=overrides or {})
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(config, kv, max_model_len=4096)


def share_of_b(s: Scheduler, weights: dict[str, float], steps: int = 1000) -> float:
    """Both tenants keep plenty of requests waiting ("a" floods with three times as many); b's share of
    the tokens computed."""
    served = dict.fromkeys(weights, 0)
    n = 0
    for step in range(steps):
        for tenant, backlog in (("a", 30), ("b", 10)):
            while sum(1 for r in s.waiting if r.tenant_id == tenant) < backlog:
                s.add_request(weighted_request(f"{tenant}{n}", tenant, weights[tenant], arrival=float(step)))
                n += 1
        for x in run_step(s).scheduled:
            served[x.request.tenant_id or ""] += x.num_new_tokens
    return served["b"] / (served["a"] + served["b"])


def test_weights_carried_by_requests_take_effect_without_any_config() -> None:
    share = share_of_b(fair_scheduler(), {"a": 1.0, "b": 3.0})
    assert abs(share - 0.75) <= 0.075, share  # within 10% of its weight


def test_the_config_overrides_the_weight_a_request_carries() -> None:
    share = share_of_b(fair_scheduler(overrides={"b": 1.0}), {"a": 1.0, "b": 3.0})
    assert abs(share - 0.5) <= 0.05, share


def test_tokens_recomputed_after_preemption_are_charged_once() -> None:
    # A pool too small for everyone's outputs: running requests preempt each other and recompute.
    s = fair_scheduler(num_blocks=12, block_size=4, prefix_caching=False)
    weights = {"a": 1.0, "b": 2.0}
    requests = [weighted_request(f"{t}{i}", t, weights[t], n_prompt=8, max_tokens=12, arrival=float(i))
                for i in range(3) for t in weights]
    for r in requests:
        s.add_request(r)
    computed: dict[str, int] = dict.fromkeys(weights, 0)  # every token computed, recomputes included
    while s.has_work:
        for x in run_step(s).scheduled:
            computed[x.request.tenant_id or ""] += x.num_new_tokens
    assert s.num_preemptions > 0, "the scenario must preempt"
    for tenant, weight in weights.items():
        mine = [r for r in requests if r.tenant_id == tenant]
        # Computed once per request: the prompt, and every output token but the last (never fed back).
        once = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in mine)
        assert computed[tenant] > once  # recomputation happened ...
        assert s.fair_share.counter(tenant) == once / weight  # ... and was not charged


def test_a_cached_prefix_is_not_charged() -> None:
    s = fair_scheduler(block_size=4)
    first = weighted_request("first", "a", n_prompt=16, max_tokens=1)
    s.add_request(first)
    drain(s)
    charged = s.fair_share.counter("a")
    assert charged == 16
    again = weighted_request("again", "a", n_prompt=16, max_tokens=1)  # the same prompt: 12 tokens cached
    s.add_request(again)
    drain(s)
    assert s.fair_share.counter("a") - charged == 16 - 12


def test_a_weight_change_applies_to_what_is_charged_next() -> None:
    s = fair_scheduler()
    s.add_request(weighted_request("r0", "a", weight=1.0, n_prompt=8, max_tokens=1))
    drain(s)
    assert s.fair_share.counter("a") == 8
    s.add_request(weighted_request("r1", "a", weight=4.0, n_prompt=8, max_tokens=1))
    drain(s)
    assert s.fair_share.counter("a") == 8 + 8 / 4
