"""Health, readiness, engine stats, Prometheus metrics and `sluice bench serve`."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx
from gateway_server import SLUICE, Server
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve import BenchConfig, run_benchmark


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


def test_bench_serve_cli_writes_sane_json(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            SLUICE,
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--num-prompts",
            "12",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--ignore-eos",
            "--request-rate",
            "200",
            "--max-concurrency",
            "6",
            "--seed",
            "3",
            "--slo-ttft-ms",
            "10000",
            "--slo-tpot-ms",
            "10000",
            "--json-out",
            str(out),
            "--no-progress",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["model"]) == (12, 0, "synthetic")
    assert result["total_output_tokens"] == 12 * 8
    assert result["total_input_tokens"] == 12 * (1 + 1 + 16 + 1 + 1)  # chat template around 16 words
    assert result["duration_s"] > 0 and result["request_throughput"] > 0
    assert result["goodput"] == result["request_throughput"]  # generous SLOs: every request is good
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p99"], (key, stats)
    assert result["e2e_ms"]["mean"] >= result["ttft_ms"]["mean"]


def test_run_benchmark_importable_counts_failures(slow_server: Server) -> None:
    config = BenchConfig(
        base_url=slow_server.base_url,
        endpoint="completions",
        num_prompts=8,
        input_len=4,
        output_len=10,
        progress=False,
    )
    result = asyncio.run(run_benchmark(config))
    # All 8 at once against 2 running + 2 waiting slots: 4 are shed with 503.
    assert (result.completed, result.failed) == (4, 4)
    assert any("503" in e for e in result.errors)
    assert result.total_output_tokens == 4 * 10 and result.goodput is None
