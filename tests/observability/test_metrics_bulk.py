"""A request's per-token latencies go into the histograms in one call a list (`observe_all`): the exposition
must be what observing them one at a time gives."""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from observability.metrics import ITL_BUCKETS, observe_all


def _families(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples if not s.name.endswith("_created")}


def test_observe_all_gives_the_exposition_of_one_observe_a_value() -> None:
    rng = random.Random(7)
    # Every bound exactly, just above and below it, zero, negatives, past the last bound, and random gaps.
    values = [b + d for b in ITL_BUCKETS for d in (0.0, 1e-12, -1e-12)] + [0.0, -0.5, 7.0, 1e9]
    values += [rng.expovariate(30.0) for _ in range(5_000)]
    one, bulk = CollectorRegistry(), CollectorRegistry()
    single = Histogram("itl", "gaps", ["model"], registry=one, buckets=ITL_BUCKETS).labels("m")
    every = Histogram("itl", "gaps", ["model"], registry=bulk, buckets=ITL_BUCKETS).labels("m")
    for v in values:
        single.observe(v)
    observe_all(every, values[:100])
    observe_all(every, values[100:])
    observe_all(every, [])
    expected, got = _families(one), _families(bulk)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if key[0] == "itl_sum":  # added in another order: equal to float rounding
            assert math.isclose(got[key], value, rel_tol=1e-12), (got[key], value)
        else:
            assert got[key] == value, key
    assert got[("itl_count", (("model", "m"),))] == len(values)
