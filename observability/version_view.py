"""Per-version figures on this replica, for comparing a canary with the current version on one screen
(the console's Models tab, `GET /admin/models/{name}/metrics`).

Read from the serving metrics when asked, never kept apart: the `model` label of every request
metric is the version id that served it (`chat@v2`), so a version's figures are the samples with
that label, summed over the other labels (node, priority, prompt bucket, tenant).

    requests    finished requests by outcome ("ok", "disconnected", "timeout", errors by name)
    ttft, itl, e2e  p50 / p99 estimated from the histogram buckets, as Prometheus'
                histogram_quantile does (linear within the bucket), in milliseconds

The figures count since this gateway process started; each replica has its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from prometheus_client import Counter, Histogram

from observability.metrics import ServingMetrics

K = TypeVar("K")
OK_OUTCOMES = frozenset({"ok", "disconnected"})  # a client leaving is not the version's fault


class VersionFigures(msgspec.Struct, frozen=True, kw_only=True):
    id: str  # the version id, as responses name it
    requests: int
    errors: int  # finished with an outcome other than ok or the client disconnecting
    outcomes: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    output_tokens: int


def version_figures(metrics: ServingMetrics, version_ids: Iterable[str]) -> list[VersionFigures]:
    outcomes = _outcomes(metrics.requests)
    ttft, itl, e2e = _buckets(metrics.ttft), _buckets(metrics.itl), _buckets(metrics.e2e)
    tokens = _token_sums(metrics)
    figures = []
    for vid in version_ids:
        by_outcome = outcomes.get(vid, {})
        figures.append(VersionFigures(
            id=vid,
            requests=sum(by_outcome.values()),
            errors=sum(n for o, n in by_outcome.items() if o not in OK_OUTCOMES),
            outcomes=by_outcome,
            ttft_p50_ms=_quantile_ms(ttft.get(vid), 0.5), ttft_p99_ms=_quantile_ms(ttft.get(vid), 0.99),
            itl_p50_ms=_quantile_ms(itl.get(vid), 0.5), itl_p99_ms=_quantile_ms(itl.get(vid), 0.99),
            e2e_p50_ms=_quantile_ms(e2e.get(vid), 0.5), e2e_p99_ms=_quantile_ms(e2e.get(vid), 0.99),
            output_tokens=tokens.get(vid, 0),
        ))
    return figures


def _outcomes(counter: Counter) -> dict[str, dict[str, int]]:
    by_status = _per_model(counter, "_total", lambda labels: labels["status"])
    return {model: {status: int(n) for status, n in per.items()} for model, per in by_status.items()}


def _token_sums(metrics: ServingMetrics) -> dict[str, int]:
    by_type = _per_model(metrics.tenant_tokens, "_total", lambda labels: labels["token_type"])
    return {model: int(per["output"]) for model, per in by_type.items() if "output" in per}


def _buckets(histogram: Histogram) -> dict[str, dict[float, float]]:
    """model -> {upper bound: cumulative count}, summed over the other labels."""
    return _per_model(histogram, "_bucket", lambda labels: float(labels["le"]))


def _per_model(metric: Counter | Histogram, suffix: str, key: Callable[[dict[str, str]], K]) -> dict[str, dict[K, float]]:
    """model -> {key of the sample's labels: value}, over the samples named `*suffix`, summed over the other labels."""
    found: dict[str, dict[K, float]] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                per = found.setdefault(sample.labels["model"], {})
                k = key(sample.labels)
                per[k] = per.get(k, 0.0) + sample.value
    return found


def _quantile_ms(cumulative: dict[float, float] | None, q: float) -> float | None:
    if not cumulative:
        return None
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]]  # the +Inf bucket: every observation
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):  # past the last finite bucket: its bound is the best we know
                return round(lower * 1000, 3)
            inside = count - below
            fraction = (rank - below) / inside if inside > 0 else 1.0
            return round((lower + (bound - lower) * fraction) * 1000, 3)
        lower, below = bound, count
    return round(lower * 1000, 3)
