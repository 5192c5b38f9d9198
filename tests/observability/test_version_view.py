"""Per-version figures read back from the serving metrics: each version's own requests, errors and
latency, whatever node, priority or tenant served them, with quantiles inside the right bucket."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from observability.metrics import ServingMetrics
from observability.timeline import ChoiceTimeline, RequestTimeline
from observability.version_view import version_figures


def _finish(metrics: ServingMetrics, model: str, ttft_s: float, outcome: str, node: str = "n0") -> None:
    started = 1000.0
    choice = ChoiceTimeline(node=node, prompt_tokens=10, completion_tokens=3, first_token=started + ttft_s,
                            last_token=started + ttft_s + 0.02, itl=[0.01, 0.01])
    timeline = RequestTimeline("r", model, "chat", "tenant-a", None, [choice], started=started)
    metrics.observe(timeline, outcome, started + ttft_s + 0.02)


def test_each_version_gets_its_own_requests_errors_and_latency() -> None:
    metrics = ServingMetrics(CollectorRegistry())
    for i in range(90):
        _finish(metrics, "chat@v1", 0.03, "ok", node=f"n{i % 2}")
    for _ in range(9):
        _finish(metrics, "chat@v2", 0.3, "ok")
    _finish(metrics, "chat@v2", 0.3, "EngineDeadError")
    _finish(metrics, "chat@v1", 0.03, "disconnected")
    v1, v2, v3 = version_figures(metrics, ["chat@v1", "chat@v2", "chat@v3"])
    assert (v1.requests, v1.errors, v1.outcomes) == (91, 0, {"ok": 90, "disconnected": 1})
    assert (v2.requests, v2.errors) == (10, 1)
    assert v1.output_tokens == 91 * 3
    assert v1.ttft_p50_ms is not None and 25 <= v1.ttft_p50_ms <= 50  # the 25-50 ms bucket
    assert v2.ttft_p99_ms is not None and 250 <= v2.ttft_p99_ms <= 500
    assert v1.itl_p50_ms is not None and 5 <= v1.itl_p50_ms <= 10
    assert (v3.requests, v3.ttft_p50_ms, v3.e2e_p99_ms) == (0, None, None)  # nothing served yet
