"""The desired-workers formula (scaling/desired.py) on hand-made fleet loads, and the cold-start hold's
bounds in time and per tier."""

from __future__ import annotations

import asyncio

import pytest

from drivers.base import ShuttingDownError
from gateway.cold_start import ColdStartHold, HoldOutcome, HoldPolicy, NoCapacityError, Readiness
from scaling.desired import Driver, FleetLoad, ScalingPolicy, desired_workers

POLICY = ScalingPolicy(ttft_targets_s=(2.0, 10.0, 30.0), headroom=0.5, min_workers=1, max_workers=20)


def test_queue_wait_against_the_tier_target_scales_the_ready_workers() -> None:
    # Tier 1 waits 10 s against a 10 s target aimed at half: twice the workers halve the wait to 5 s.
    d = desired_workers(FleetLoad(ready_workers=3, wait_s_by_tier={0: 0.5, 1: 10.0, 2: 10.0}), POLICY)
    assert (d.workers, d.driver, d.tier) == (6, Driver.QUEUE_WAIT, 1)
    assert d.pressure == pytest.approx(2.0)


def test_the_premium_tier_decides_when_its_tight_target_is_nearest() -> None:
    d = desired_workers(FleetLoad(ready_workers=2, wait_s_by_tier={0: 1.5, 1: 1.5, 2: 1.5}), POLICY)
    assert (d.workers, d.tier) == (3, 0)  # 1.5 / (0.5 x 2) = 1.5 -> ceil(2 x 1.5)


def test_kv_pressure_and_occupancy_count_when_queues_are_short() -> None:
    kv = desired_workers(FleetLoad(ready_workers=4, kv_blocks_used=950, kv_blocks_total=1000), POLICY)
    assert (kv.workers, kv.driver) == (5, Driver.KV_CACHE)  # 0.95 / 0.8 x 4 = 4.75
    busy = desired_workers(FleetLoad(ready_workers=2, running=128, max_num_seqs=128), POLICY)
    assert (busy.workers, busy.driver) == (3, Driver.OCCUPANCY)  # 1 / 0.9 x 2
    # Compute-bound: few slots used, no queue yet, but prompts take 0.9 of the measured prefill rate.
    hot = desired_workers(FleetLoad(ready_workers=4, running=20, max_num_seqs=1024, prefill_utilization=0.9),
                          POLICY)
    assert (hot.workers, hot.driver) == (7, Driver.PREFILL)  # 0.9 / 0.55 x 4 = 6.5


def test_an_idle_fleet_falls_to_the_minimum_and_bounds_hold() -> None:
    assert desired_workers(FleetLoad(ready_workers=8), POLICY).workers == 1
    scale_to_zero = ScalingPolicy(min_workers=0)
    assert desired_workers(FleetLoad(ready_workers=8), scale_to_zero).workers == 0
    flood = desired_workers(FleetLoad(ready_workers=10, wait_s_by_tier={1: 500.0}), POLICY)
    assert flood.workers == POLICY.max_workers
    # A backlog asks for at most twice the ready workers per reading.
    backlog = desired_workers(FleetLoad(ready_workers=3, wait_s_by_tier={1: 100.0}), POLICY)
    assert (backlog.workers, backlog.pressure) == (6, pytest.approx(20.0))


def test_no_ready_worker_with_demand_is_the_activation_signal() -> None:
    policy = ScalingPolicy(min_workers=0)
    d = desired_workers(FleetLoad(ready_workers=0, held=3), policy)
    assert (d.workers, d.driver) == (1, Driver.ACTIVATION)
    assert desired_workers(FleetLoad(ready_workers=0), policy).workers == 0


def test_bad_policies_are_refused() -> None:
    for bad in ({"headroom": 0.0}, {"kv_target": 1.5}, {"prefill_target": 0.0}, {"min_workers": 5, "max_workers": 2}, {"max_step_up": 0.5},
                {"ttft_targets_s": ()}):
        with pytest.raises(ValueError):
            ScalingPolicy(**bad)  # type: ignore[arg-type]


def test_hold_releases_waiters_when_ready_refuses_beyond_the_bound_and_times_out() -> None:
    asyncio.run(asyncio.wait_for(_hold_scenario(), 60))


async def _hold_scenario() -> None:
    ready = asyncio.Event()

    async def is_ready() -> Readiness:
        return Readiness.READY if ready.is_set() else Readiness.STARTING

    async def starting() -> Readiness:
        return Readiness.STARTING

    async def down() -> Readiness:
        return Readiness.DOWN

    hold = ColdStartHold(HoldPolicy(max_held=(2,), timeout_s=30.0, poll_s=0.01), is_ready)
    waiters = [asyncio.create_task(hold.wait(1)) for _ in range(2)]
    while hold.total_held < 2:
        await asyncio.sleep(0.01)
    with pytest.raises(NoCapacityError) as full:
        await hold.wait(1)
    assert full.value.outcome is HoldOutcome.FULL and full.value.retry_after >= 1
    ready.set()
    await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert hold.total_held == 0
    await hold.wait(1)  # ready: passes at once

    never = ColdStartHold(HoldPolicy(max_held=(4,), timeout_s=0.05, poll_s=0.01), starting)
    with pytest.raises(NoCapacityError) as late:
        await never.wait(0)
    assert late.value.outcome is HoldOutcome.TIMEOUT and never.total_held == 0
    # The server starts draining: a held request ends with 503 at once rather than at its deadline.
    draining = ColdStartHold(HoldPolicy(max_held=(4,), timeout_s=600.0, poll_s=0.01), starting)
    held = asyncio.create_task(draining.wait(0))
    while not draining.total_held:
        await asyncio.sleep(0.01)
    draining.stopping = lambda: True
    with pytest.raises(ShuttingDownError):
        await held
    # Down, nothing coming (an engine died and restarts): not held, the request fails the usual way.
    broken = ColdStartHold(HoldPolicy(max_held=(0,), timeout_s=600.0), down)
    await broken.wait(1)  # returns at once even with a bound of 0
    for h in (hold, never, draining, broken):
        await h.close()
