"""The by-length latency view's samples: a bounded reservoir that keeps every value with the same chance, and
the output-position buckets each gap lands in."""

from __future__ import annotations

import random
import statistics

from observability.length_view import POSITION_LABELS, LengthLatencyView, _Reservoir
from observability.timeline import ChoiceTimeline, RequestTimeline


def test_a_reservoir_below_its_cap_keeps_every_value_in_order() -> None:
    r = _Reservoir()
    r.add([1.0, 2.0], 5, random.Random(0))
    r.add([3.0], 5, random.Random(0))
    assert r.samples == [1.0, 2.0, 3.0] and r.count == 3


def test_a_full_reservoir_keeps_each_value_with_the_same_chance() -> None:
    n, cap, trials = 400, 40, 3_000
    kept = [0] * n
    for seed in range(trials):
        r = _Reservoir()
        rng = random.Random(seed)
        start = 0
        for size in (1, 39, 2, 150, 7, 201):  # batches across the fill and past it
            r.add([float(v) for v in range(start, start + size)], cap, rng)
            start += size
        assert start == n and r.count == n and len(r.samples) == cap and len(set(r.samples)) == cap
        for v in r.samples:
            kept[int(v)] += 1
    # Each value is kept with probability cap / n = 0.1: 300 of 3,000 trials, standard deviation ~16.4.
    expected = trials * cap / n
    assert all(abs(k - expected) < 6 * 16.4 for k in kept), (min(kept), max(kept))
    for part in (kept[:cap], kept[cap:n // 2], kept[n // 2:]):  # the fill, the middle, the end alike
        assert abs(statistics.mean(part) - expected) < 0.05 * expected, statistics.mean(part)


def test_how_values_are_batched_does_not_change_the_sample() -> None:
    values = [float(v) for v in range(1_000)]
    whole, split = _Reservoir(), _Reservoir()
    whole.add(values, 32, random.Random(3))
    rng = random.Random(3)
    for i in range(0, 1_000, 70):
        split.add(values[i:i + 70], 32, rng)
    assert whole.samples == split.samples and whole.count == split.count == 1_000


def test_a_zero_cap_counts_and_keeps_nothing() -> None:
    r = _Reservoir()
    r.add([1.0, 2.0, 3.0], 0, random.Random(0))
    assert r.samples == [] and r.count == 3


def test_each_gap_lands_in_its_output_position_bucket() -> None:
    # Gap i comes before output token i + 2: 1,100 gaps are tokens 2-1,101.
    gaps = [0.001 * (i + 1) for i in range(1_100)]
    choice = ChoiceTimeline(node="n", prompt_tokens=10, completion_tokens=1_101, first_token=100.5,
                            last_token=101.6, itl=gaps)
    view = LengthLatencyView(max_samples=2_000, clock=lambda: 130.0)
    view.observe(RequestTimeline("r", "m", "chat", None, None, [choice], started=100.0))
    lines = {line.bucket: line.points[-1] for line in view.report().itl_by_position}
    counts = {label: p.count for label, p in lines.items() if p is not None}
    assert counts == dict(zip(POSITION_LABELS, (15, 48, 192, 768, 77), strict=True))
    # Each bucket's samples are its own gaps: its p50 is the middle of its slice.
    assert lines["2-16"] is not None and lines["2-16"].p50_ms == 8.0  # gaps 1-15 ms
    assert lines[">1k"] is not None and lines[">1k"].p50_ms == 1_062.0  # gaps 1,024-1,100 ms
    prompt = view.report().itl_by_prompt
    assert [(line.bucket, line.points[-1].count if line.points[-1] else 0) for line in prompt] == [("<=128", 1_100)]
