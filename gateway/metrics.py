"""Prometheus metrics of one gateway app, in a registry of its own (never the global one), so
several apps in one process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Label values for `endpoint`: known routes by path, everything else collapsed to keep cardinality bounded.
KNOWN_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/engine/stats",
    }
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sluice_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of finished generations", ["model"], registry=self.registry
        )
        self.completion_tokens = Counter(
            "sluice_completion_tokens", "Completion tokens generated", ["model"], registry=self.registry
        )
        self.in_flight = Gauge(
            "sluice_requests_in_flight", "Generation requests being served now", registry=self.registry
        )
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Time from request arrival to the first token",
            ["model"],
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )
        self.e2e = Histogram(
            "sluice_request_duration_seconds",
            "Time from request arrival to the last byte of a generation",
            ["model"],
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
        )

        self.shed_requests = Counter(
            "sluice_shed_requests",
            "Requests refused by admission control (503 + Retry-After), by priority tier and the check that refused",
            ["priority", "reason"],
            registry=self.registry,
        )
        self.ttft_prediction_ratio = Histogram(
            "sluice_ttft_prediction_ratio",
            "Admitted requests' real time to first token over the one admission control predicted (1 = exact)",
            registry=self.registry,
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
        )

        self.cold_start = Counter(
            "sluice_cold_start_requests",
            "Requests that found no ready worker, by priority tier and how it ended: served once a worker "
            "was ready, refused because the tier's hold was full, or timed out (gateway/cold_start.py)",
            ["priority", "outcome"],
            registry=self.registry,
        )
        self.cold_start_wait = Histogram(
            "sluice_cold_start_wait_seconds",
            "Time requests waited for a first worker",
            registry=self.registry,
            buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
        )

    # -- gateway.cold_start.HoldMetrics ----------------------------------------------------------

    def held(self, tier: int, outcome: str, waited_s: float) -> None:
        self.cold_start.labels(priority=str(tier), outcome=str(outcome)).inc()
        if waited_s > 0:
            self.cold_start_wait.observe(waited_s)

    # -- gateway.load_shedding.SheddingMetrics ---------------------------------------------------

    def shed(self, priority: int, reason: str) -> None:
        self.shed_requests.labels(priority=str(priority), reason=str(reason)).inc()

    def ttft_prediction(self, actual_over_predicted: float) -> None:
        self.ttft_prediction_ratio.observe(actual_over_predicted)

    def observe_response(self, path: str, status: int) -> None:
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
