"""Admission control without a model: the shedder's decisions from hand-made driver health, and the
whole path through the app on the synthetic driver (503 + Retry-After, lowest tier first)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from msgspec.structs import replace

from drivers.base import DriverHealth, OverloadedError
from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.load_shedding import LoadShedder, SheddingPolicy
from gateway.settings import Settings


def health(**kw: object) -> DriverHealth:
    base: dict[str, object] = {
        "ready": True,
        "running": 8,
        "max_num_seqs": 8,
        "max_waiting": 100,
        "max_waiting_tokens": 10_000,
        "prompt_tokens_per_s": 500.0,
        "generation_tokens_per_s": 500.0,
    }
    return DriverHealth(**{**base, **kw})  # type: ignore[arg-type]


def outcome(
    shedder: LoadShedder, h: DriverHealth, priority: int, prompt: int = 10, max_tokens: int = 10
) -> str:
    try:
        shedder.admit(h, priority, prompt, max_tokens)
    except OverloadedError as exc:
        assert exc.retry_after >= 1
        return "shed"
    return "admitted"


def test_wait_counts_only_work_of_equal_or_higher_priority() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0))
    h = health(waiting=30, waiting_work_by_priority={0: 1_000, 1: 4_000, 2: 20_000})
    assert shedder.estimate(h, 0).wait_s == pytest.approx(1.0)
    assert shedder.estimate(h, 1).wait_s == pytest.approx(5.0)
    assert shedder.estimate(h, 2).wait_s == pytest.approx(25.0)


def test_under_overload_tier_2_is_shed_while_tier_0_is_admitted() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0, 10.0, 30.0)))
    # 40 s of tier-2 work queued at 1,000 tokens/s: tier 2 would wait 40 s > 30 s; tier 0 waits ~0.
    h = health(waiting=40, waiting_work_by_priority={2: 40_000})
    assert outcome(shedder, h, 2) == "shed"
    assert outcome(shedder, h, 1) == "admitted"
    assert outcome(shedder, h, 0) == "admitted"
    assert shedder.shed_total == {2: 1}


def test_a_growing_backlog_sheds_tiers_from_the_lowest_up() -> None:
    """Sweep the backlog: the backlog at which each tier is first shed grows with its importance."""
    first_shed: dict[int, int] = {}
    for backlog_s in range(0, 400, 5):
        # A realistic mix: most of the queue is batch work, a little is premium.
        work = {0: backlog_s * 1000 // 100, 1: backlog_s * 1000 * 9 // 100, 2: backlog_s * 1000 * 90 // 100}
        h = health(waiting=min(backlog_s, 60), waiting_work_by_priority=work)
        for tier in (0, 1, 2):
            if tier not in first_shed and outcome(LoadShedder(SheddingPolicy(trust_after=0)), h, tier) == "shed":
                first_shed[tier] = backlog_s
    assert first_shed[2] < first_shed[1] < first_shed[0]


def test_retry_after_is_the_time_until_the_wait_meets_the_target() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0, 10.0, 30.0)))
    h = health(waiting=50, waiting_work_by_priority={2: 45_000})  # 45 s vs 30 s
    with pytest.raises(OverloadedError) as info:
        shedder.admit(h, 2, 10, 10)
    assert info.value.retry_after == 15


def test_queue_share_keeps_headroom_for_higher_tiers_before_any_throughput_is_measured() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0, queue_share=(1.0, 0.9, 0.75)))
    # A burst at an idle engine whose figures have not caught up yet: 8 run, then the queue fills.
    h = health(running=0, waiting=0, prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0)
    for _ in range(8 + 75):
        assert outcome(shedder, h, 2) == "admitted"
    assert shedder.estimate(h, 2).wait_s is None  # nothing measured: only the shares decide
    assert outcome(shedder, h, 2) == "shed"
    for _ in range(15):
        assert outcome(shedder, h, 1) == "admitted"  # up to 90
    assert outcome(shedder, h, 1) == "shed"
    for _ in range(10):
        assert outcome(shedder, h, 0) == "admitted"  # up to the whole bound
    assert outcome(shedder, h, 0) == "shed"


def test_token_bound_share() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0, queue_share=(1.0, 0.9, 0.5)))
    h = health(waiting=2, waiting_tokens=4_900, waiting_work_by_priority={0: 10})
    assert outcome(shedder, h, 2, prompt=200) == "shed"  # 5,100 > 5,000
    assert outcome(shedder, h, 0, prompt=200) == "admitted"


def test_requests_sent_count_until_the_engine_reports_them() -> None:
    """The engine's figures lag a burst; the gateway's own count of what it sent does not."""
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0, 10.0, 30.0)))
    # Saturated (4 running of 4, by figures a moment old), nothing queued in them yet.
    h = health(running=4, max_num_seqs=4, waiting=0, waiting_work_by_priority={})
    sent = [shedder.admit(h, 0, 100, 100) for _ in range(4)]  # they take the free running slots
    assert shedder.estimate(h, 0).waiting == 0
    sent.append(shedder.admit(h, 1, 100, 100))
    est = shedder.estimate(h, 1)  # 1 of the 5 is queued: a fifth of their work and tokens
    assert est.waiting == 1 and est.waiting_tokens == 100 and est.wait_s == pytest.approx(0.2)
    assert shedder.estimate(h, 0).wait_s == pytest.approx(0.16)  # tier 1's work is not ahead of tier 0
    # Fresher engine figures that already show more work win over the local count.
    busy = health(running=4, max_num_seqs=4, waiting=20, waiting_work_by_priority={0: 5_000})
    assert shedder.estimate(busy, 0).wait_s == pytest.approx(5.0)
    for pending in sent[:4]:
        shedder.started(pending)  # first tokens: no longer queued, still in flight
    est = shedder.estimate(h, 1)
    assert est.waiting == 1 and est.wait_s == pytest.approx(0.2)  # the fifth is all that waits
    for pending in sent + sent:  # finished() twice is harmless
        shedder.finished(pending)
    assert shedder._unstarted == {} and shedder.in_flight == 0
    assert shedder.estimate(h, 2).wait_s == 0.0
    idle = health(running=0, waiting=0)
    shedder.admit(idle, 2, 100, 100)
    # It fits a free slot and no prompt rate is measured yet: nothing predicts a wait.
    assert not shedder.estimate(idle, 2).wait_s


def test_throughput_of_an_unsaturated_engine_is_not_used() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0))
    h = health(running=2, waiting=0, waiting_work_by_priority={2: 50_000})
    assert not shedder.estimate(h, 2).wait_s  # no positive wait from the throughput of an idle engine


def test_below_the_running_cap_a_first_token_waits_only_on_prompts_ahead_and_nothing_is_refused() -> None:
    """Queued requests' decodes run batched beside a newcomer's prefill: only prompt tokens are ahead
    of it (the work of max_tokens is not), at the rate prompts were computed while queued. Below the
    running cap the request joins the batch at once and the cap bounds what is ahead: a load the server
    serves, however slowly (a steady 32-stream closed loop at a cap of 64 was refused before), so the
    TTFT target refuses nothing there."""
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0, 10.0, 30.0)))
    h = health(
        running=32, max_num_seqs=64, waiting=6,
        prefill_waiting_by_priority={0: 100, 1: 13_000}, prefill_running=200, prefill_tokens_per_s=1_000.0,
        waiting_work_by_priority={0: 100 + 200, 1: 13_000 + 6 * 200},
    )
    assert shedder.estimate(h, 1, prompt_tokens=500).wait_s == pytest.approx((200 + 100 + 13_000 + 500) / 1_000)
    assert shedder.estimate(h, 0, prompt_tokens=500).wait_s == pytest.approx((200 + 100 + 500) / 1_000)
    assert not shedder.estimate(h, 1).queues_for_slot
    assert outcome(shedder, h, 1, prompt=500, max_tokens=4_000) == "admitted"  # 13.8 s > 10 s, below the cap
    assert outcome(shedder, h, 0, prompt=1_500) == "admitted"
    # The engine's running and waiting requests reach the cap: the next one would queue for a slot.
    at_cap = replace(h, waiting=32)
    assert shedder.estimate(at_cap, 1).queues_for_slot
    assert outcome(shedder, at_cap, 1) == "shed"  # 13.3 s of prompts ahead > 10 s
    assert outcome(shedder, at_cap, 0) == "admitted"  # 1.5 s of tier-0 prompts ahead (the one sent above)
    assert shedder.shed_total == {1: 1}


def test_the_gateways_own_requests_in_flight_count_against_the_running_cap() -> None:
    """Engine figures a moment old show free slots; what this gateway sent since fills them."""
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0, 10.0, 30.0)))
    h = health(running=0, max_num_seqs=4, waiting=0, prefill_tokens_per_s=100.0)
    for _ in range(4):
        assert outcome(shedder, h, 1, prompt=500) == "admitted"  # 5-20 s of prompts, below the cap
    assert shedder.estimate(h, 1).queues_for_slot
    assert outcome(shedder, h, 1, prompt=10) == "shed"  # 20 s of our own unstarted prompts ahead


def test_a_request_is_never_refused_for_its_own_prompt() -> None:
    """Its own prompt's time is no wait, and no retry could cut it: only work ahead counts against the
    target (a lone 3,000-token prompt on an idle server with a 2 s target was refused before)."""
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0,)))
    idle = health(running=0, max_num_seqs=8, prefill_tokens_per_s=1_000.0)
    assert shedder.estimate(idle, 0, prompt_tokens=3_000).wait_s == pytest.approx(3.0)
    shedder.finished(shedder.admit(idle, 0, 3_000, 10))
    full = health(running=8, max_num_seqs=8, prefill_tokens_per_s=1_000.0)  # at the cap, nothing queued
    shedder.finished(shedder.admit(full, 0, 30_000, 10))
    behind = replace(full, waiting=3, prefill_waiting_by_priority={0: 2_500}, waiting_work_by_priority={0: 2_600})
    with pytest.raises(OverloadedError) as info:
        shedder.admit(behind, 0, 10, 10)
    assert info.value.retry_after == 1  # 2.6 s ahead vs 2 s: ceil(0.6)
    assert "work ahead" in str(info.value)


def test_calibration_follows_the_real_time_to_first_token_and_is_exported() -> None:
    from gateway.metrics import GatewayMetrics

    now = [0.0]
    metrics = GatewayMetrics()
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(100.0,)), metrics, clock=lambda: now[0])
    h = health(running=1, max_num_seqs=64, prefill_tokens_per_s=100.0)
    for _ in range(60):  # every request really waits twice what was predicted
        pending = shedder.admit(h, 0, prompt_tokens=100, max_tokens=1)  # predicted 1 s
        now[0] += 2.0
        shedder.started(pending)
        shedder.finished(pending)
    assert shedder.calibration == pytest.approx(2.0, rel=0.02)
    assert shedder.estimate(h, 0, prompt_tokens=100).wait_s == pytest.approx(2.0, rel=0.02)
    ratios = metrics.registry.get_sample_value("sluice_ttft_prediction_ratio_count")
    assert ratios == 60
    # The first prediction was off by 2x; the last ones, calibrated, are close to exact.
    assert metrics.registry.get_sample_value("sluice_ttft_prediction_ratio_bucket", {"le": "1.1"}) >= 30


def test_an_unproven_estimate_refuses_only_what_a_quarter_of_it_misses() -> None:
    # A fresh server's first rates come from a cold prefix cache (prompts sharing a system prompt then
    # looked 10x longer than they were): until `trust_after` first tokens have checked the estimate,
    # it is read at its most optimistic, the calibration's lower bound.
    now = [0.0]
    shedder = LoadShedder(SheddingPolicy(ttft_targets_s=(10.0,), trust_after=4), clock=lambda: now[0])
    free = health(running=1, max_num_seqs=64, prefill_tokens_per_s=100.0)
    # At the running cap behind 2,000 and 5,000 prompt tokens: 20 s and 50 s ahead, 5 s and 12.5 s at a quarter.
    behind = {n: health(running=64, max_num_seqs=64, waiting=1, prefill_tokens_per_s=100.0,
                        prefill_waiting_by_priority={0: n}) for n in (2_000, 5_000)}
    first = shedder.admit(free, 0, prompt_tokens=2_000, max_tokens=1)
    shedder.finished(first)  # ended without a first token: checks nothing
    shedder.finished(shedder.admit(behind[2_000], 0, 10, 1))  # a quarter of 20 s: admitted
    assert outcome(shedder, behind[5_000], 0) == "shed"  # even a quarter misses 10 s
    for _ in range(4):  # four first tokens come when predicted
        pending = shedder.admit(free, 0, prompt_tokens=100, max_tokens=1)
        now[0] += 1.0
        shedder.started(pending)
        shedder.finished(pending)
    assert shedder.checked == 4 and shedder.calibration == pytest.approx(1.0)
    assert outcome(shedder, behind[2_000], 0) == "shed"  # proven: 20 s at face value


def test_refusals_are_counted_by_priority_and_reason() -> None:
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    shedder = LoadShedder(SheddingPolicy(trust_after=0, ttft_targets_s=(2.0, 10.0, 30.0)), metrics)
    h = health(waiting=50, waiting_work_by_priority={2: 45_000})
    assert outcome(shedder, h, 2) == "shed"
    full = health(waiting=100)
    assert outcome(shedder, full, 1) == "shed"
    sample = metrics.registry.get_sample_value
    assert sample("sluice_shed_requests_total", {"priority": "2", "reason": "ttft_target"}) == 1
    assert sample("sluice_shed_requests_total", {"priority": "1", "reason": "queue_share"}) == 1


def test_disabled_policy_admits_everything() -> None:
    shedder = LoadShedder(SheddingPolicy(trust_after=0, enabled=False))
    h = health(waiting=100, waiting_work_by_priority={2: 10**9})
    assert outcome(shedder, h, 2) == "admitted"


def test_through_the_app_on_the_synthetic_driver_lowest_tier_is_refused_first() -> None:
    """A slow synthetic engine with a queue of 8: a burst of tier-2 requests fills its share (6) and the
    rest get 503 + Retry-After; tier 0 still gets in; the body's priority is used as is without auth."""
    driver = SyntheticDriver(tokens_per_second=20, ttft_s=0.01, max_num_seqs=2, max_waiting=8)
    settings = Settings(auth=False, queue_share=(1.0, 0.9, 0.75))
    app = create_app(settings, driver)

    async def main() -> tuple[list[int], list[int], set[str]]:
        await driver.start()  # the app's lifespan only starts the driver when auth is off
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]  # concurrent, unlike the test client
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:

            async def one(priority: int) -> httpx.Response:
                body = {"prompt": "a b c", "max_tokens": 3, "priority": priority}
                return await client.post("/v1/completions", json=body)

            low = await asyncio.gather(*(one(2) for _ in range(20)))
            high = await asyncio.gather(*(one(0) for _ in range(2)))
            retry = {r.headers.get("retry-after", "") for r in low if r.status_code == 503}
            return [r.status_code for r in low], [r.status_code for r in high], retry

    low, high, retry = asyncio.run(main())
    assert set(low) == {200, 503}
    assert low.count(200) == 2 + 6  # running slots + tier 2's share of the queue
    assert all(r.isdigit() and int(r) >= 1 for r in retry)
    assert high == [200, 200]


def test_without_auth_a_request_that_names_no_priority_is_standard_not_premium() -> None:
    driver = SyntheticDriver(tokens_per_second=5, ttft_s=0.01, max_num_seqs=1, max_waiting=8)
    app = create_app(Settings(auth=False), driver)

    async def main() -> dict[int, int]:
        await driver.start()
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            body = {"prompt": "a b c", "max_tokens": 20}
            first = asyncio.create_task(client.post("/v1/completions", json=body))  # takes the one slot
            while (await driver.health()).running == 0:
                await asyncio.sleep(0.01)
            second = asyncio.create_task(client.post("/v1/completions", json=body))  # queues behind it
            while not (await driver.health()).waiting:
                await asyncio.sleep(0.01)
            queued = dict((await driver.health()).waiting_work_by_priority)
            await asyncio.gather(first, second)
            return queued

    queued = asyncio.run(main())
    assert list(queued) == [1]


def test_body_priority_rejects_negative_values() -> None:
    app = create_app(Settings(auth=False), SyntheticDriver(tokens_per_second=0, ttft_s=0))
    from litestar.testing import TestClient

    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": -1})
        assert resp.status_code == 400
        resp = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": 2})
        assert resp.status_code == 200
