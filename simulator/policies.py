"""Scaling policies the simulator compares.

    fixed             a constant number of workers, all day
    reactive          the desired-workers signal (scaling/desired.py, the gateway's own formula) as an
                      HPA applies it: scale up at once, scale down to the highest figure of the last
                      `stabilization_s` (the HPA's default scale-down window, 300 s)
    reactive+forecast the reactive figure, but never below what an hour-of-day forecast of the arrival
                      rate needs one cold start ahead: the rate a previous day had at that hour over
                      what a worker serves (`worker_capacity_rps`) at `utilization`
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from scaling.desired import FleetLoad, ScalingPolicy, desired_workers
from simulator.profile import CostProfile
from simulator.traffic import DAY, HOUR, Arrivals, Workload


@dataclass
class Fixed:
    size: int
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"fixed-{self.size}"

    def workers(self, now: float, load: FleetLoad, current: int) -> int:
        return self.size


@dataclass
class Reactive:
    scaling: ScalingPolicy
    stabilization_s: float = 300.0
    name: str = "reactive"
    _history: deque[tuple[float, int]] = field(default_factory=deque)

    def workers(self, now: float, load: FleetLoad, current: int) -> int:
        desired = desired_workers(load, self.scaling).workers
        if load.ready_workers < current and desired <= load.ready_workers:
            # Workers still booting were asked for by an earlier figure: keep them unless even the
            # ready ones are more than needed.
            desired = min(current, max(desired, load.ready_workers))
        self._history.append((now, desired))
        while self._history and self._history[0][0] < now - self.stabilization_s:
            self._history.popleft()
        if desired >= current:
            return desired
        return max(d for _, d in self._history)  # scale down only as far as the whole window allows


@dataclass
class Forecast:
    """Reactive, with a floor from the arrival rate expected one cold start (plus an interval) ahead."""

    reactive: Reactive
    hourly_rps: np.ndarray  # expected arrivals per second at each hour of the day
    worker_capacity_rps: float
    lead_s: float
    utilization: float = 0.8
    name: str = "reactive+forecast"

    def expected_rps(self, t: float) -> float:
        hours = (t % DAY) / HOUR
        shape = np.append(self.hourly_rps, self.hourly_rps[0])
        return float(np.interp(hours, np.arange(25), shape))

    def workers(self, now: float, load: FleetLoad, current: int) -> int:
        floor = math.ceil(self.expected_rps(now + self.lead_s) / (self.worker_capacity_rps * self.utilization))
        return max(self.reactive.workers(now, load, current), floor, self.reactive.scaling.min_workers)


def hourly_rates(history: Arrivals, days: int = 1) -> np.ndarray:
    """Arrivals per second at each hour of the day, from a previous day's arrivals (the forecast)."""
    counts = np.bincount(((history.time % DAY) // HOUR).astype(np.int64), minlength=24)[:24]
    return counts / (HOUR * days)


def worker_capacity_rps(profile: CostProfile, workload: Workload, seed: int = 0) -> float:
    """Requests per second one worker sustains on this workload, from its cost profile: at a full batch
    (bounded by KV), each request costs its prefill plus its share of the decode steps."""
    rng = np.random.default_rng(seed)
    _, prompt, output = workload.draw(20_000, rng)
    p, o = float(prompt.mean()), float(output.mean())
    batch = max(1, min(profile.max_num_seqs, int(profile.kv_tokens / (p + o))))
    step = profile.decode_step_s(batch, int(batch * (p + o / 2)))
    per_request = profile.prefill_s(int(p)) + o * step / batch
    return 1.0 / per_request
