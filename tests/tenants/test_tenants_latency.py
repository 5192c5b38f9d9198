"""Latency percentiles from usage records: nearest rank, groups by day and model, completed requests only."""

from __future__ import annotations

import datetime as dt

from tenants.latency import LatencyReport, LatencySample, Percentiles, nearest_rank

T0 = dt.datetime(2030, 1, 1, 23, 30, tzinfo=dt.UTC)


def test_nearest_rank_is_a_recorded_value() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [nearest_rank(values, q) for q in (50, 90, 99, 100)] == [50.0, 90.0, 99.0, 100.0]
    assert nearest_rank([7.0], 50) == 7.0
    assert nearest_rank([1.0, 2.0], 50) == 1.0 and nearest_rank([1.0, 2.0], 51) == 2.0


def test_percentiles_of_nothing_is_none() -> None:
    assert Percentiles.of([]) is None
    assert Percentiles.of([3.0, 1.0, 2.0]) == Percentiles(2.0, 3.0, 3.0)


def test_report_groups_by_day_and_model_and_skips_missing_ttft() -> None:
    samples = [
        LatencySample(T0, "a", 10.0, 100.0),
        LatencySample(T0 + dt.timedelta(hours=1), "b", None, 300.0),  # next day (UTC); no first token
        LatencySample(T0 + dt.timedelta(hours=1), "a", 30.0, 200.0),
    ]
    by_day = LatencyReport.of("t", T0, T0, "day", samples, truncated=False)
    assert [(g.group, g.requests) for g in by_day.groups] == [("2030-01-01", 1), ("2030-01-02", 2)]
    assert by_day.groups[1].ttft_ms == Percentiles(30.0, 30.0, 30.0)
    assert by_day.overall.requests == 3 and by_day.overall.latency_ms == Percentiles(200.0, 300.0, 300.0)
    by_model = LatencyReport.of("t", T0, T0, "model", samples, truncated=False)
    assert [g.group for g in by_model.groups] == ["a", "b"]
    assert by_model.groups[1].ttft_ms is None
    assert by_model.groups[1].latency_ms == Percentiles(300.0, 300.0, 300.0)
