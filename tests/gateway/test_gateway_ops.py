"""Health, readiness, engine stats and Prometheus metrics (`sluice bench serve`: tests/benchmarks)."""

from __future__ import annotations

import httpx
from gateway_server import Server
from prometheus_client.parser import text_string_to_metric_families


def test_health_and_readiness(server: Server) -> None:
    assert httpx.get(server.base_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.base_url + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    stats = httpx.get(server.v1 + "/engine/stats").json()
    assert {"ready", "running", "waiting"} <= set(stats)


def test_metrics_parse_and_count(server: Server) -> None:
    httpx.post(server.v1 + "/completions", json={"prompt": "a b", "max_tokens": 3})
    httpx.get(server.v1 + "/definitely-not-here")
    text = httpx.get(server.base_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in families["sluice_http_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests[("/v1/completions", "200")] >= 1
    assert requests[("other", "404")] >= 1
    completion = [s for s in families["sluice_completion_tokens"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in completion) >= 3
    ttft_count = [
        s for s in families["sluice_time_to_first_token_seconds"].samples if s.name.endswith("_count")
    ]
    assert ttft_count and ttft_count[0].value >= 1
    in_flight = families["sluice_requests_in_flight"].samples[0].value
    assert in_flight == 0
