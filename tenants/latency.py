"""Latency percentiles of a tenant's requests (time to first token and end to end), from its usage records.

Percentiles use the nearest-rank method (the smallest recorded value with at least q% of the
values at or below it), so every figure is a latency some request really had. Only completed
requests count (status "ok"): refusals and disconnects would drag the figures toward zero.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

QUANTILES = (50, 90, 99)
MAX_SAMPLES = 100_000
"""Most recent records read per report: bounds memory and time for a very busy tenant."""


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) of ascending `sorted_values` (not empty)."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles | None:
        ordered = sorted(values)
        if not ordered:
            return None
        return cls(*(round(nearest_rank(ordered, q), 3) for q in QUANTILES))


@dataclass(frozen=True)
class LatencySample:
    created_at: dt.datetime
    model: str
    ttft_ms: float | None
    latency_ms: float

    @property
    def day(self) -> str:
        return self.created_at.astimezone(dt.UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True)
class LatencyGroup:
    group: str  # a day (YYYY-MM-DD, UTC), a model id, or "all"
    requests: int
    ttft_ms: Percentiles | None  # None when no request in the group streamed a first token
    latency_ms: Percentiles | None

    @classmethod
    def of(cls, group: str, samples: Sequence[LatencySample]) -> LatencyGroup:
        return cls(
            group=group,
            requests=len(samples),
            ttft_ms=Percentiles.of(s.ttft_ms for s in samples if s.ttft_ms is not None),
            latency_ms=Percentiles.of(s.latency_ms for s in samples),
        )


@dataclass(frozen=True)
class LatencyReport:
    tenant_id: str
    start: dt.datetime
    end: dt.datetime
    group_by: Literal["day", "model"]
    groups: list[LatencyGroup]  # ordered by group
    overall: LatencyGroup
    truncated: bool  # more than MAX_SAMPLES records in range: figures cover the most recent ones

    @classmethod
    def of(
        cls,
        tenant_id: str,
        start: dt.datetime,
        end: dt.datetime,
        group_by: Literal["day", "model"],
        samples: Sequence[LatencySample],
        truncated: bool,
    ) -> LatencyReport:
        by_group: dict[str, list[LatencySample]] = defaultdict(list)
        for s in samples:
            by_group[s.day if group_by == "day" else s.model].append(s)
        groups = [LatencyGroup.of(g, by_group[g]) for g in sorted(by_group)]
        return cls(tenant_id, start, end, group_by, groups, LatencyGroup.of("all", samples), truncated)
