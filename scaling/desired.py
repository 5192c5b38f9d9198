"""The desired-workers figure: how many workers would keep every tier inside its TTFT target.

Inputs are what one gateway sees of its fleet (`FleetLoad`); the output is a whole number of workers
with the term that decided it (`Desired`). The gateway exports it (`sluice_desired_workers`, and in
`GET /admin/nodes`), and the simulator's reactive policies call the same function, so what the
simulator shows is what an autoscaler reading the metric would do.

    pressure = max(
        max over tiers p of  wait(p) / (headroom x target(p)),   queue wait vs the tier's TTFT target
        kv_used / kv_total / kv_target,                          KV cache pressure
        running / max_num_seqs / occupancy_target,               batch slots in use
        prefill_utilization / prefill_target,                    compute spent on prompts
    )
    desired  = ceil(ready x min(pressure, max_step_up)), within [min_workers, max_workers]

Each term is a load divided by the capacity of the `ready` workers that serve it, so with `ready x
pressure` workers it would sit at its target: a queue wait scales as 1 / workers (the same queued work
drains over more workers), KV use and occupancy too. `headroom` (0.5) aims the estimated wait at half
the target, so that scaling starts before the shedder (gateway/load_shedding.py, which refuses at the
target itself) has to. The estimate `wait(p)` is the shedder's, calibrated against real TTFTs.

`prefill_utilization` is the prompt tokens computed per second over the rate the workers computed
prompts at while work was queued (their measured prefill capacity). It is what keeps a compute-bound
fleet from oscillating: queue wait and slots say nothing until the workers are saturated, so without
it a fleet that just drained its backlog asks to shrink to where the backlog comes back.
`prefill_target` (0.55) leaves the rest of a worker's time to its decode steps.

`max_step_up` (2) caps one reading at twice the ready workers. A burst's backlog, measured as a
wait, asks for the fleet that would drain it at once, many times what the burst's rate needs; by the
time those workers have booted the backlog is gone and they are drained again (the simulator shows
a 2-worker fleet asking for 36 in a 4x burst without the cap). Doubling per cold start reaches any
size in a few steps while new workers keep lowering the pressure.

With no ready worker there is no capacity to scale: any demand (requests held at the gateway, queued,
or running) asks for `max(min_workers, 1)`: the activation signal of scale from zero. Scaling down
is smoothed by the orchestrator (an HPA's stabilization window), not here: this figure is what is
needed now.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalingPolicy:
    """Targets of the desired-workers formula; one per gateway (SLUICE_SCALING_* in gateway/settings.py)."""

    ttft_targets_s: tuple[float, ...] = (2.0, 10.0, 30.0)
    """TTFT target per tier, tier 0 first (the shedder's, SLUICE_TTFT_TARGETS_S)."""
    headroom: float = 0.5
    """Fraction of a tier's TTFT target the estimated queue wait may reach before more workers are asked
    for (SLUICE_SCALING_HEADROOM)."""
    kv_target: float = 0.8
    """KV cache use per worker to aim at; above it preemptions start (SLUICE_SCALING_KV_TARGET)."""
    occupancy_target: float = 0.9
    """Running sequences / max_num_seqs to aim at (SLUICE_SCALING_OCCUPANCY_TARGET)."""
    prefill_target: float = 0.55
    """Share of the workers' measured prefill capacity to aim at (SLUICE_SCALING_PREFILL_TARGET)."""
    min_workers: int = 1
    """Fewest workers asked for (SLUICE_SCALING_MIN_WORKERS). 1 by default: a gateway with its engine in
    process (embedded) is itself the worker and cannot hold requests at zero; a fleet whose gateway runs
    apart from its workers sets 0 to let an idle fleet scale to zero."""
    max_workers: int = 64
    """Most workers asked for (SLUICE_SCALING_MAX_WORKERS)."""
    max_step_up: float = 2.0
    """Most one reading asks for, as a multiple of the ready workers (SLUICE_SCALING_MAX_STEP_UP)."""

    def __post_init__(self) -> None:
        if not self.ttft_targets_s or min(self.ttft_targets_s) <= 0:
            raise ValueError("TTFT targets must be positive")
        targets = (self.headroom, self.kv_target, self.occupancy_target, self.prefill_target)
        if not all(0 < t <= 1 for t in targets):
            raise ValueError("headroom, kv_target, occupancy_target and prefill_target lie in (0, 1]")
        if self.max_step_up < 1:
            raise ValueError("max_step_up >= 1")
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError("0 <= min_workers <= max_workers")

    def target(self, tier: int) -> float:
        return self.ttft_targets_s[min(max(tier, 0), len(self.ttft_targets_s) - 1)]


@dataclass(frozen=True)
class FleetLoad:
    """What the formula reads: the load of the ready workers, summed, and the gateway's own queue."""

    ready_workers: int
    wait_s_by_tier: dict[int, float] = field(default_factory=dict)  # estimated queue wait; unknown: absent
    running: int = 0
    waiting: int = 0  # queued in the engines
    held: int = 0  # held at the gateway while no worker is ready (gateway/cold_start.py)
    max_num_seqs: int = 0  # all ready workers; 0: unknown
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0  # 0: unknown
    prefill_utilization: float | None = None  # prompt tokens/s over measured prefill capacity; None: unknown


class Driver(enum.StrEnum):
    """The term of the formula that decided the figure."""

    IDLE = "idle"  # no load at all
    ACTIVATION = "activation"  # demand and no ready worker: scale from zero
    QUEUE_WAIT = "queue_wait"
    KV_CACHE = "kv_cache"
    OCCUPANCY = "occupancy"
    PREFILL = "prefill"


@dataclass(frozen=True)
class Desired:
    workers: int
    pressure: float  # the max of the terms; 1.0 = the ready workers are exactly at target
    driver: Driver
    tier: int | None = None  # the tier whose wait decided it, for QUEUE_WAIT


def desired_workers(load: FleetLoad, policy: ScalingPolicy) -> Desired:
    """The formula of the module docstring."""
    demand = load.held + load.waiting + load.running
    if load.ready_workers <= 0:
        if demand:
            return Desired(min(policy.max_workers, max(policy.min_workers, 1)), math.inf, Driver.ACTIVATION)
        return Desired(policy.min_workers, 0.0, Driver.IDLE)
    terms: list[tuple[float, Driver, int | None]] = [(0.0, Driver.IDLE, None)]
    for t, wait in load.wait_s_by_tier.items():
        terms.append((wait / (policy.headroom * policy.target(t)), Driver.QUEUE_WAIT, t))
    if load.kv_blocks_total > 0:
        terms.append((load.kv_blocks_used / load.kv_blocks_total / policy.kv_target, Driver.KV_CACHE, None))
    if load.max_num_seqs > 0:
        terms.append((load.running / load.max_num_seqs / policy.occupancy_target, Driver.OCCUPANCY, None))
    if load.prefill_utilization is not None:
        terms.append((load.prefill_utilization / policy.prefill_target, Driver.PREFILL, None))
    pressure, driver, tier_of = max(terms, key=lambda t: t[0])
    # A hair below an integer is that integer (float noise must not ask for a whole extra worker).
    workers = math.ceil(load.ready_workers * min(pressure, policy.max_step_up) - 1e-9)
    if demand and workers == 0:
        workers = 1  # something runs or waits: keep a worker for it
    return Desired(min(policy.max_workers, max(policy.min_workers, workers)), pressure, driver, tier_of)
