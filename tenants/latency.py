"""Latency percentiles of a tenant's requests (time to first token and end to end), from its usage records.

Percentiles use the nearest-rank method (the smallest recorded value with at least q% of the
values at or below it), so every figure is a latency some request really had. Only completed
requests count (status "ok"): refusals and disconnects would drag the figures toward zero.

The database computes them (`UsageRepository.latency_ranks`): PostgreSQL with
`percentile_disc`, which is nearest rank, SQLite by ranking rows with window functions and
keeping only the ranks asked for. The gateway receives a handful of numbers per group and
never sorts records. Both read at most the `max_samples` newest records in range, which
bounds the work of one report for a very busy tenant.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Literal

QUANTILES = (50, 90, 99)
MAX_SAMPLES = 100_000
"""Most recent records read per report: bounds the database's work for a very busy tenant."""


def nearest_rank(count: int, q: int) -> int:
    """The 1-based rank of the q-th percentile (0 < q <= 100) among `count` (> 0) ascending values."""
    return max(1, math.ceil(q * count / 100))


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: tuple[float | None, ...]) -> Percentiles | None:
        """From the values at QUANTILES' ranks; None when there were no values."""
        if any(v is None for v in values):
            return None
        return cls(*(round(float(v), 3) for v in values if v is not None))


@dataclass(frozen=True)
class LatencyGroup:
    group: str  # a day (YYYY-MM-DD, UTC), a model id, or "all"
    requests: int
    ttft_ms: Percentiles | None  # None when no request in the group streamed a first token
    latency_ms: Percentiles | None


@dataclass(frozen=True)
class GroupRanks:
    """What the database answers for one group: its size and the values at QUANTILES' ranks."""

    group: str | None  # None: all records in range
    requests: int
    ttft_ms: tuple[float | None, ...]
    latency_ms: tuple[float | None, ...]

    def to_group(self) -> LatencyGroup:
        return LatencyGroup(
            group=self.group if self.group is not None else "all",
            requests=self.requests,
            ttft_ms=Percentiles.of(self.ttft_ms),
            latency_ms=Percentiles.of(self.latency_ms),
        )


@dataclass(frozen=True)
class LatencyReport:
    tenant_id: str
    start: dt.datetime
    end: dt.datetime
    group_by: Literal["day", "model"]
    groups: list[LatencyGroup]  # ordered by group
    overall: LatencyGroup
    truncated: bool  # more than max_samples records in range: figures cover the most recent ones

    @classmethod
    def of(
        cls,
        tenant_id: str,
        start: dt.datetime,
        end: dt.datetime,
        group_by: Literal["day", "model"],
        ranks: list[GroupRanks],
        truncated: bool,
    ) -> LatencyReport:
        groups = sorted((r.to_group() for r in ranks if r.group is not None), key=lambda g: g.group)
        overall = next((r.to_group() for r in ranks if r.group is None), None)
        empty = LatencyGroup("all", 0, None, None)
        return cls(tenant_id, start, end, group_by, groups, overall or empty, truncated)
