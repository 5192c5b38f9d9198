"""A real `sluice serve --driver synthetic` with OTLP export to a receiver in the test: /metrics
parsed with prometheus_client's parser counts exactly the requests and tokens served, and every
request's trace arrives, continuing the caller's traceparent, with the engine's events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gateway_server import Server, start_server
from otlp_receiver import Receiver, otlp_receiver
from prometheus_client.parser import text_string_to_metric_families

N_PLAIN, N_STREAM, MAX_TOKENS = 6, 4, 12


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[Server, Receiver]]:
    with otlp_receiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        for server in start_server("--synthetic-tokens-per-second", "500", "--synthetic-ttft-ms", "5", env=env):
            yield server, receiver


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, []) if all(labels.get(k) == x for k, x in match.items()))


def test_metrics_count_requests_and_tokens_and_traces_continue_the_callers(traced: tuple[Server, Receiver]) -> None:
    server, receiver = traced
    parents = {}

    def one(i: int) -> int:
        trace_id, span_id = f"{i + 1:032x}", f"{i + 1:016x}"
        headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
        body = {"model": "synthetic", "prompt": " ".join(["word"] * (10 + i)), "max_tokens": MAX_TOKENS,
                "stream": i >= N_PLAIN, "stream_options": {"include_usage": True} if i >= N_PLAIN else None}
        r = httpx.post(f"{server.v1}/completions", json={k: v for k, v in body.items() if v is not None},
                       headers=headers, timeout=30)
        assert r.status_code == 200
        parents[trace_id] = span_id
        if i < N_PLAIN:
            return int(r.json()["usage"]["completion_tokens"])
        usage = [line for line in r.text.splitlines() if '"usage"' in line and '"completion_tokens"' in line]
        return int(httpx.Response(200, content=usage[-1].removeprefix("data: ")).json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(4) as pool:
        completion = list(pool.map(one, range(N_PLAIN + N_STREAM)))
    n = N_PLAIN + N_STREAM
    assert completion == [MAX_TOKENS] * n

    m = _samples(httpx.get(f"{server.base_url}/metrics").text)
    model = {"model": "synthetic"}
    assert _total(m, "gen_ai_server_time_to_first_token_seconds_count", **model) == n
    assert _total(m, "gen_ai_server_request_duration_seconds_count", **model) == n
    assert _total(m, "gen_ai_server_time_per_output_token_seconds_count", **model) == n
    assert _total(m, "sluice_inter_token_latency_seconds_count", **model) == sum(c - 1 for c in completion)
    assert _total(m, "sluice_request_queue_time_seconds_count", **model) == n
    # engine token time -> the gateway took the chunk: one per chunk with a token (the synthetic driver's carry one)
    assert _total(m, "sluice_token_delivery_seconds_count", node="synthetic", **model) == sum(completion)
    assert 0 <= _total(m, "sluice_token_delivery_seconds_sum", **model) < _total(
        m, "gen_ai_server_request_duration_seconds_sum", **model)
    assert _total(m, "gen_ai_client_token_usage_count", token_type="output") == n
    assert _total(m, "gen_ai_client_token_usage_sum", token_type="output") == sum(completion)
    assert _total(m, "sluice_requests_total", status="ok", tenant="none") == n
    assert _total(m, "sluice_tenant_tokens_total", token_type="output") == sum(completion)
    # labels: node, priority tier and prompt-length bucket
    ttft_labels = [labels for labels, _ in m["gen_ai_server_time_to_first_token_seconds_count"]]
    # No auth: every request is the standard tier (1).
    assert {(x["node"], x["priority"], x["prompt_bucket"]) for x in ttft_labels} == {("synthetic", "1", "<=128")}
    assert _total(m, "sluice_node_up", node="synthetic") == 1
    # the pre-existing gateway metrics still count
    assert _total(m, "sluice_completion_tokens_total", **model) == sum(completion)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with receiver.lock:
            spans = list(receiver.spans)
        if sum(s.name == "text_completion synthetic" for s in spans) >= n:
            break
        time.sleep(0.2)
    roots = [s for s in spans if s.name == "text_completion synthetic"]
    assert len(roots) == n
    by_id = {s.span_id: s for s in spans}
    for root in roots:
        trace_id = root.trace_id.hex()
        assert root.parent_span_id.hex() == parents[trace_id]  # the caller's span is our parent
        attrs = {a.key: a.value for a in root.attributes}
        assert attrs["gen_ai.request.model"].string_value == "synthetic"
        assert attrs["gen_ai.usage.output_tokens"].int_value == MAX_TOKENS
        assert attrs["sluice.status"].string_value == "ok"
        children = [s for s in spans if s.parent_span_id == root.span_id]
        assert [c.name for c in children] == ["sluice.driver.generate"]
        child = children[0]
        assert child.trace_id == root.trace_id and by_id[child.parent_span_id] is root
        events = [e.name for e in child.events]
        assert events == ["queued", "scheduled", "first_token", "finished"]
        times = [e.time_unix_nano for e in child.events]
        assert times == sorted(times) and root.start_time_unix_nano <= times[0] <= root.end_time_unix_nano


def test_nodes_endpoint_shape(traced: tuple[Server, Receiver]) -> None:
    server, _ = traced
    report = httpx.get(f"{server.base_url}/admin/nodes").json()
    assert set(report) >= {"nodes", "events"}
    node = report["nodes"][0]
    for key in ("id", "status", "running", "waiting", "kv_blocks_used", "kv_blocks_total", "tokens_per_s",
                "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "reason", "since"):
        assert key in node
    assert node["status"] == "healthy"
