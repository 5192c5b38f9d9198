"""Arrivals for the simulator: when each request comes, its tier, prompt and output lengths.

`day()` is a working day as an inference service sees it: a quiet night, a morning ramp to a peak
around 10:00, a dip at lunch, an afternoon plateau, an evening decline, plus short bursts (a batch job,
a client's retry storm) at random times. The rate is a non-homogeneous Poisson process, drawn by
thinning. `poisson()` is the constant-rate case of the queueing checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HOUR = 3600.0
DAY = 24 * HOUR

# Relative rate by hour of day (1.0 = the peak), linearly interpolated between the hours.
DAILY_SHAPE = (0.12, 0.10, 0.09, 0.09, 0.10, 0.14, 0.25, 0.45, 0.75, 0.95, 1.00, 0.92,
               0.80, 0.85, 0.90, 0.88, 0.80, 0.65, 0.50, 0.40, 0.33, 0.25, 0.18, 0.14)


@dataclass(frozen=True)
class Arrivals:
    """One row per request, sorted by time."""

    time: np.ndarray  # seconds from the start
    tier: np.ndarray  # 0 premium, 1 standard, 2 batch
    prompt: np.ndarray  # prompt tokens
    output: np.ndarray  # output tokens (>= 1)

    def __len__(self) -> int:
        return len(self.time)


@dataclass(frozen=True)
class Workload:
    """What a request looks like: tier mix and length distributions (lognormal, clipped)."""

    tier_mix: tuple[float, ...] = (0.2, 0.5, 0.3)
    prompt_median: float = 800.0
    prompt_sigma: float = 0.9
    output_median: float = 200.0
    output_sigma: float = 0.7
    max_prompt: int = 16_000
    max_output: int = 2_000

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tier = rng.choice(len(self.tier_mix), size=n, p=np.asarray(self.tier_mix) / sum(self.tier_mix))
        prompt = np.clip(rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, n), 1, self.max_prompt)
        output = np.clip(rng.lognormal(math.log(self.output_median), self.output_sigma, n), 1, self.max_output)
        return tier.astype(np.int64), prompt.astype(np.int64), output.astype(np.int64)


@dataclass(frozen=True)
class Burst:
    start_s: float
    duration_s: float
    factor: float  # rate multiplier while it lasts


@dataclass(frozen=True)
class DayShape:
    peak_rps: float = 40.0
    """Requests per second at the daily peak (before bursts)."""
    bursts: int = 4
    """Bursts during working hours (08:00-18:00)."""
    burst_factor: float = 2.0
    burst_minutes: float = 8.0
    shape: tuple[float, ...] = DAILY_SHAPE

    def rate(self, t: np.ndarray, bursts: list[Burst]) -> np.ndarray:
        hours = (t % DAY) / HOUR
        shape = np.asarray(self.shape)
        base = np.interp(hours, np.arange(25), np.append(shape, shape[0])) * self.peak_rps
        factor = np.ones_like(t)
        for b in bursts:
            factor = np.where((t >= b.start_s) & (t < b.start_s + b.duration_s), factor * b.factor, factor)
        return base * factor

    def hourly_rps(self) -> np.ndarray:
        """The expected rate at each hour of the day, without bursts: what a forecast learns."""
        return np.asarray(self.shape) * self.peak_rps


def day(shape: DayShape, workload: Workload, seed: int, days: int = 1) -> tuple[Arrivals, list[Burst]]:
    rng = np.random.default_rng(seed)
    duration = days * DAY
    bursts = [
        Burst(float(start), shape.burst_minutes * 60, shape.burst_factor)
        for d in range(days)
        for start in np.sort(rng.uniform(d * DAY + 8 * HOUR, d * DAY + 18 * HOUR, shape.bursts))
    ]
    ceiling = shape.peak_rps * max(shape.shape) * max([shape.burst_factor] + [1.0]) ** (shape.bursts > 0)
    # Thinning: candidates at the ceiling rate, each kept with probability rate(t) / ceiling.
    n = rng.poisson(ceiling * duration)
    t = np.sort(rng.uniform(0, duration, n))
    keep = rng.uniform(0, ceiling, n) < shape.rate(t, bursts)
    t = t[keep]
    tier, prompt, output = workload.draw(len(t), rng)
    return Arrivals(t, tier, prompt, output), bursts


def poisson(rate: float, duration_s: float, workload: Workload, seed: int) -> Arrivals:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, int(rate * duration_s * 1.2) + 100)
    t = np.cumsum(gaps)
    t = t[t < duration_s]
    tier, prompt, output = workload.draw(len(t), rng)
    return Arrivals(t, tier, prompt, output)
