"""Serving metrics: latency histograms per model / node / priority tier / prompt-length bucket,
request and token counters per tenant, and per-node gauges read from the driver at scrape time.

Names follow the OpenTelemetry GenAI semantic conventions where one exists (in Prometheus form:
dots become underscores, the unit a suffix): gen_ai.server.time_to_first_token ->
`gen_ai_server_time_to_first_token_seconds`, and so on; Sluice's own carry a `sluice_` prefix.
Everything goes into the app's prometheus registry (`GET /metrics`); with an OTLP endpoint the
same observations also go to an OpenTelemetry meter (`OtlpMirror`), and only then.

Cardinality: tenants appear on counters only, and only the first `tenant_cap` tenants seen get
their own label value; later ones are "other". What the value is, the tenant's id, its name or
nothing ("none" for all), is the operator's choice (`TenantLabel`, SLUICE_METRICS_TENANT_LABEL).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from drivers.base import NodesReport
from observability.node_health import prompt_bucket
from observability.timeline import RequestTimeline

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DELIVERY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
LABELS = ("model", "node", "priority", "prompt_bucket")


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every v, as one addition per bucket and one to the sum.

    A request's inter-token gaps and delivery lags are observed when it ends, a value a token: one
    `observe` each took two locked increments per token (with the by-length samples' draws ~3 µs of
    the gateway's ~75 µs of CPU a streamed token, docs/observability.md "Overhead"). The counts come
    out the same (a value goes to the first bucket whose bound is >= it, as `observe` puts it; values
    are numbers, never NaN); the sum is added in one piece, so its last bits may differ.
    prometheus_client has no public call for this: it reaches into its Histogram (`_upper_bounds`,
    `_buckets`, `_sum`), and tests/observability/test_metrics_bulk.py holds it to `observe`'s
    exposition, so a release that moves them fails there.
    """
    bounds: list[float] = histogram._upper_bounds  # type: ignore[attr-defined]
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1  # the last bound is +Inf
    buckets = histogram._buckets  # type: ignore[attr-defined]
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)
    histogram._sum.inc(math.fsum(values))  # type: ignore[attr-defined]


class TenantLabel(StrEnum):
    """What the `tenant` label of the per-tenant counters shows."""

    ID = "id"  # the tenant id from the admin API
    NAME = "name"  # the tenant's name, as the admin API last showed it to the gateway
    NONE = "none"  # nothing: every request counts under tenant="none"


class TenantLabels:
    """Bounded tenant label values: the first `cap` tenants seen get their own, the rest are "other".

    Requests carry tenant ids; names are `learn`ed when a caller authenticates (before its request
    can be counted), and a rename shows from the tenant's next request on.
    """

    def __init__(self, cap: int, mode: TenantLabel = TenantLabel.ID) -> None:
        self.cap = cap
        self.mode = mode
        self._seen: set[str] = set()
        self._names: dict[str, str] = {}

    def _admit(self, tenant: str) -> bool:
        if tenant in self._seen:
            return True
        if len(self._seen) < self.cap:
            self._seen.add(tenant)
            return True
        return False

    def learn(self, tenant: str, name: str) -> None:
        if self.mode is TenantLabel.NAME and self._admit(tenant):
            self._names[tenant] = name

    def __call__(self, tenant: str | None) -> str:
        if tenant is None or self.mode is TenantLabel.NONE:
            return "none"
        if self.mode is TenantLabel.NAME:
            return self._names.get(tenant, "other")
        return tenant if self._admit(tenant) else "other"

    @property
    def otel_attribute(self) -> str | None:
        """The OTLP attribute that carries the label; None: none is sent."""
        return {TenantLabel.ID: "sluice.tenant.id", TenantLabel.NAME: "sluice.tenant.name"}.get(self.mode)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry, tenant_cap: int = 100, mirror: OtlpMirror | None = None,
                 tenant_label: TenantLabel = TenantLabel.ID):
        self.tenants = TenantLabels(tenant_cap, tenant_label)
        self.mirror = mirror

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = LABELS) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        self.ttft = hist("gen_ai_server_time_to_first_token_seconds",
                         "Time from request arrival at the gateway to its first token", LATENCY_BUCKETS)
        self.itl = hist("sluice_inter_token_latency_seconds", "Time between consecutive output tokens",
                        ITL_BUCKETS)
        # Engine token time -> the gateway takes the chunk: what the engine's token times (ITL above) do not
        # show of a client's inter-token gaps, e.g. a blocked event loop. Same-host clocks: local engines only
        # (a fleet worker's chunks carry no token time).
        self.delivery = hist("sluice_token_delivery_seconds",
                             "Time from the engine producing a token to the gateway taking it for the response",
                             DELIVERY_BUCKETS, ("model", "node"))
        self.tpot = hist("gen_ai_server_time_per_output_token_seconds",
                         "Per request: decode time / (output tokens - 1)", ITL_BUCKETS)
        self.e2e = hist("gen_ai_server_request_duration_seconds",
                        "Time from request arrival at the gateway to its last token", E2E_BUCKETS)
        self.queue = hist("sluice_request_queue_time_seconds",
                          "Time a request waited in the engine before it was first scheduled", LATENCY_BUCKETS)
        self.token_usage = hist("gen_ai_client_token_usage", "Tokens per request, input or output",
                                TOKEN_BUCKETS, ("model", "token_type"))
        self.requests = Counter("sluice_requests", "Generation requests by outcome",
                                ["model", "tenant", "status"], registry=registry)
        self.tenant_tokens = Counter("sluice_tenant_tokens", "Tokens by tenant, input (prompt) or output",
                                     ["model", "tenant", "token_type"], registry=registry)
        self.preemptions = Counter("sluice_request_preemptions", "Preemptions of served requests",
                                   ["model", "node"], registry=registry)

    def observe(self, t: RequestTimeline, outcome: str, ended: float) -> None:
        model = t.model
        prompt_total = completion_total = 0
        for c in t.choices:
            labels = (model, c.node or "none", str(c.priority), prompt_bucket(c.prompt_tokens))
            prompt_total += c.prompt_tokens
            completion_total += c.completion_tokens
            if c.first_token is not None:
                self.ttft.labels(*labels).observe(c.first_token - t.started)
                self.e2e.labels(*labels).observe((c.last_token or ended) - t.started)
            if c.itl:
                observe_all(self.itl.labels(*labels), c.itl)
                if c.first_token is not None and c.last_token is not None:
                    self.tpot.labels(*labels).observe((c.last_token - c.first_token) / len(c.itl))
            if c.delivery:
                observe_all(self.delivery.labels(model, c.node or "none"), c.delivery)
            if c.arrival is not None and c.scheduled is not None:
                self.queue.labels(*labels).observe(max(0.0, c.scheduled - c.arrival))
            if c.preemption_times:
                self.preemptions.labels(model, c.node or "none").inc(len(c.preemption_times))
            if self.mirror is not None:
                self.mirror.observe_choice(t, c, ended)
        self.token_usage.labels(model, "input").observe(prompt_total)
        self.token_usage.labels(model, "output").observe(completion_total)
        tenant = self.tenants(t.tenant)
        self.requests.labels(model, tenant, outcome).inc()
        self.tenant_tokens.labels(model, tenant, "input").inc(prompt_total)
        self.tenant_tokens.labels(model, tenant, "output").inc(completion_total)
        if self.mirror is not None:
            self.mirror.observe_request(t, self.tenants.otel_attribute, tenant, outcome, prompt_total,
                                        completion_total)


class NodeCollector(Collector):
    """Per-node gauges, read from the driver when scraped: nothing is kept up to date in between."""

    def __init__(self, nodes: Callable[[], NodesReport]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        nodes = self._nodes().nodes
        for name, doc, value in _NODE_GAUGES:
            yield _per_node(GaugeMetricFamily, name, doc, nodes, value)
        for name, doc, value in _NODE_COUNTERS:
            yield _per_node(CounterMetricFamily, name, doc, nodes, value)
        yield from _fleet_families([n for n in nodes if n.address is not None])


_NodeValue = Callable[[Any], float | None]  # None: no sample yet, so no series rather than a false 0


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


_NODE_GAUGES: list[tuple[str, str, _NodeValue]] = [
    ("sluice_node_running_requests", "Requests running on the node", lambda n: n.running),
    ("sluice_node_waiting_requests", "Requests waiting on the node", lambda n: n.waiting),
    ("sluice_node_kv_blocks_used", "KV cache blocks in use", lambda n: n.kv_blocks_used),
    ("sluice_node_kv_blocks_total", "KV cache blocks in the pool", lambda n: n.kv_blocks_total),
    ("sluice_node_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens looked up",
     lambda n: n.prefix_cache_hit_rate),
    ("sluice_node_generation_tokens_per_second", "Recent output tokens per second",
     lambda n: n.tokens_per_s),
    ("sluice_node_sluggish", "1 when the node's latency stands out from its peers'",
     lambda n: float(n.status == "sluggish")),
    ("sluice_node_stalled", "1 when the node has work but produced no token for a while",
     lambda n: float(n.status == "stalled")),
    ("sluice_node_up", "1 when the node's engine process is alive", lambda n: float(n.status != "dead")),
    ("sluice_node_ttft_p50_seconds", "Time to first token on the node, median over the health window",
     lambda n: _seconds(n.ttft_p50_ms)),
    ("sluice_node_itl_p50_seconds", "Inter-token latency on the node, median over the health window",
     lambda n: _seconds(n.itl_p50_ms)),
    ("sluice_node_itl_p99_seconds", "Inter-token latency on the node, p99 over the health window",
     lambda n: _seconds(n.itl_p99_ms)),
]
_NODE_COUNTERS: list[tuple[str, str, _NodeValue]] = [
    ("sluice_node_preemptions", "Preemptions since the node started", lambda n: n.preemptions),
    # A tensor-parallel engine's step split: compute = forward - collective (docs/parallelism.md).
    ("sluice_node_forward_seconds", "Seconds in the model forward (tensor-parallel engines)",
     lambda n: n.forward_seconds),
    ("sluice_node_collective_seconds", "Seconds of the forward in collectives (tensor-parallel engines)",
     lambda n: n.collective_seconds),
]
_WORKER_COUNTERS: list[tuple[str, str, _NodeValue]] = [
    ("sluice_fleet_worker_requests", "Attempts this gateway sent the worker", lambda n: n.requests),
    ("sluice_fleet_worker_errors", "Attempts lost on the worker (refused connection, cut, stalled, timed out)",
     lambda n: n.errors),
    ("sluice_fleet_worker_failovers", "Requests moved off the worker to another after a failure there",
     lambda n: n.failovers),
]

_F = TypeVar("_F", GaugeMetricFamily, CounterMetricFamily)


def _per_node(family_type: type[_F], name: str, doc: str, nodes: list[Any], value: _NodeValue) -> _F:
    """One family labelled by node, a sample for each node that has a value."""
    family = family_type(name, doc, labels=["node"])
    for n in nodes:
        if (v := value(n)) is not None:
            family.add_metric([n.id], v)
    return family


def _fleet_families(workers: list[Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """What this gateway saw of each fleet worker (drivers/fleet): its traffic and its circuit."""
    if not workers:
        return
    for name, doc, value in _WORKER_COUNTERS:
        yield _per_node(CounterMetricFamily, name, doc, workers, value)
    yield _per_node(GaugeMetricFamily, "sluice_fleet_worker_in_flight", "Streams this gateway has open on the worker",
                    workers, lambda n: n.in_flight)
    circuit = GaugeMetricFamily("sluice_fleet_worker_circuit", "1 for the worker's circuit breaker state",
                                labels=["node", "state"])
    for n in workers:
        for state in ("closed", "open", "half_open"):
            circuit.add_metric([n.id, state], float(n.circuit == state))
    yield circuit


class OtlpMirror:
    """The same figures through an OpenTelemetry meter, exported over OTLP/HTTP periodically."""

    def __init__(self, endpoint: str, nodes: Callable[[], NodesReport], service_name: str = "sluice",
                 export_interval_s: float = 10.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.metrics import CallbackOptions, Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{endpoint.rstrip('/')}/v1/metrics"),
            export_interval_millis=export_interval_s * 1000,
        )
        self.provider = MeterProvider([reader], resource=Resource.create({"service.name": service_name}))
        meter = self.provider.get_meter("sluice")

        def hist(name: str, unit: str, buckets: tuple[float, ...]) -> Any:
            return meter.create_histogram(name, unit=unit, explicit_bucket_boundaries_advisory=list(buckets))

        self.ttft = hist("gen_ai.server.time_to_first_token", "s", LATENCY_BUCKETS)
        self.tpot = hist("gen_ai.server.time_per_output_token", "s", ITL_BUCKETS)
        self.e2e = hist("gen_ai.server.request.duration", "s", E2E_BUCKETS)
        self.queue = hist("sluice.request.queue_time", "s", LATENCY_BUCKETS)
        self.token_usage = hist("gen_ai.client.token.usage", "{token}", TOKEN_BUCKETS)
        self.requests = meter.create_counter("sluice.requests", unit="{request}")
        self.tenant_tokens = meter.create_counter("sluice.tenant.tokens", unit="{token}")

        def gauge(name: str, value: Callable[[Any], float]) -> None:
            def callback(_: CallbackOptions) -> list[Observation]:
                return [Observation(value(n), {"sluice.node.id": n.id}) for n in nodes().nodes]

            meter.create_observable_gauge(name, [callback])

        gauge("sluice.node.running_requests", lambda n: n.running)
        gauge("sluice.node.waiting_requests", lambda n: n.waiting)
        gauge("sluice.node.kv_blocks_used", lambda n: n.kv_blocks_used)
        gauge("sluice.node.kv_blocks_total", lambda n: n.kv_blocks_total)
        gauge("sluice.node.preemptions", lambda n: n.preemptions)
        gauge("sluice.node.prefix_cache_hit_rate", lambda n: n.prefix_cache_hit_rate)
        gauge("sluice.node.sluggish", lambda n: float(n.status == "sluggish"))

    def observe_choice(self, t: RequestTimeline, c: Any, ended: float) -> None:
        attrs = {"gen_ai.request.model": t.model, "sluice.node.id": c.node or "none",
                 "sluice.priority": c.priority, "sluice.prompt_bucket": prompt_bucket(c.prompt_tokens)}
        if c.first_token is not None:
            self.ttft.record(c.first_token - t.started, attrs)
            self.e2e.record((c.last_token or ended) - t.started, attrs)
        # Per-token ITL stays Prometheus-only: an SDK record() per token costs more than the rest of
        # the request's telemetry together; OTLP gets the per-request TPOT (the GenAI convention's).
        if c.itl and c.first_token is not None and c.last_token is not None:
            self.tpot.record((c.last_token - c.first_token) / len(c.itl), attrs)
        if c.arrival is not None and c.scheduled is not None:
            self.queue.record(max(0.0, c.scheduled - c.arrival), attrs)

    def observe_request(self, t: RequestTimeline, tenant_attribute: str | None, tenant: str, outcome: str,
                        prompt: int, completion: int) -> None:
        self.token_usage.record(prompt, {"gen_ai.request.model": t.model, "gen_ai.token.type": "input"})
        self.token_usage.record(completion, {"gen_ai.request.model": t.model, "gen_ai.token.type": "output"})
        by_tenant = {"gen_ai.request.model": t.model, **({tenant_attribute: tenant} if tenant_attribute else {})}
        self.requests.add(1, {**by_tenant, "sluice.status": outcome})
        for kind, n in (("input", prompt), ("output", completion)):
            self.tenant_tokens.add(n, {**by_tenant, "gen_ai.token.type": kind})

    def shutdown(self) -> None:
        self.provider.shutdown()
