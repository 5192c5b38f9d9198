"""Observability across the gateway -> worker hop, on real processes: the worker's span continues
the gateway's trace (W3C traceparent on the generate request), and the gateway's /metrics counts
what it sent each worker, what was lost there and moved elsewhere, its latency and its circuit.
Gateway and workers export OTLP/HTTP to a receiver in the test."""

from __future__ import annotations

import httpx
from fleet_processes import WorkerProcess, gateway, nodes
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.observability.otlp_receiver import Receiver, otlp_receiver
from tests.polling import wait_until

PACED = ["--driver", "synthetic", "--synthetic-tokens-per-second", "40", "--synthetic-ttft-ms", "10"]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def spans(receiver: Receiver, name: str) -> list[Span]:
    with receiver.lock:
        return [s for s in receiver.spans if s.name == name]


def metric(base: str, series: str) -> float | None:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def complete(base: str, prompt: str, headers: dict[str, str] | None = None) -> None:
    r = httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                   json={"model": "synthetic", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def test_worker_span_continues_the_gateway_trace_and_metrics_count_per_worker() -> None:
    with otlp_receiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        # w0 accepts work but would take 30 s to its first token: past the gateway's first-token
        # timeout, a loss there and a failover to w1, while w0 stays alive and in the view.
        with WorkerProcess("w0", ["--driver", "synthetic", "--synthetic-ttft-ms", "30000"], env) as w0, \
                WorkerProcess("w1", PACED, env) as w1, \
                gateway("--workers", f"{w0.url},{w1.url}", "--fleet-policy", "round-robin",
                        "--fleet-first-token-timeout", "1", env=env) as base:
            wait_until(lambda: len(nodes(base)) == 2, "both workers in the view")
            complete(base, "a traced request", {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
            complete(base, "an untraced caller")  # the gateway starts the trace; the workers join it

            # Every worker span (w0's lost attempt included) is a child of a gateway choice span
            # ("sluice.driver.generate") of the same trace.
            worker_spans = wait_until(lambda: len(s := spans(receiver, "sluice.worker.generate")) >= 3 and s,
                                      "the workers' spans exported")
            driver_spans = wait_until(lambda: len(s := spans(receiver, "sluice.driver.generate")) >= 2 and s,
                                      "the gateway's spans exported")
            by_id = {s.span_id: s for s in driver_spans}
            for w in worker_spans:
                assert by_id[w.parent_span_id].trace_id == w.trace_id
            assert bytes.fromhex(CALLER_TRACE) in {w.trace_id for w in worker_spans}
            assert len({w.trace_id for w in worker_spans}) == 2
            assert {_attribute(w, "sluice.node.id") for w in worker_spans} == {"w0", "w1"}

            # Round-robin sent w0 one of the two requests first: lost there, moved to w1.
            assert (metric(base, 'sluice_fleet_worker_errors_total{node="w0"}') or 0) >= 1
            assert (metric(base, 'sluice_fleet_worker_failovers_total{node="w0"}') or 0) >= 1
            assert metric(base, 'sluice_fleet_worker_failovers_total{node="w1"}') == 0
            assert metric(base, 'sluice_fleet_worker_requests_total{node="w1"}') == 2
            assert (metric(base, 'sluice_node_ttft_p50_seconds{node="w1"}') or 0) > 0
            for w in ("w0", "w1"):  # the breaker's state, one-hot
                states = [metric(base, f'sluice_fleet_worker_circuit{{node="{w}",state="{state}"}}')
                          for state in ("closed", "open", "half_open")]
                assert sorted(states) == [0, 0, 1]


def _attribute(span: Span, key: str) -> str:
    return next(a.value.string_value for a in span.attributes if a.key == key)
