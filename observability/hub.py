"""The one object the gateway talks to: start a request's timeline, finish it (metrics, trace).

Built once per app from settings; `tracer` and `mirror` exist only with an OTLP endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from drivers.base import GenerationRequest, NodesReport
from observability.length_view import LengthLatencyView
from observability.metrics import NodeCollector, OtlpMirror, ServingMetrics, TenantLabel
from observability.timeline import ChoiceTimeline, RequestTimeline
from observability.tracing import RequestTracer


@dataclass(frozen=True)
class ObservabilityConfig:
    otlp_endpoint: str | None = None
    """OTLP/HTTP base URL (OTEL_EXPORTER_OTLP_ENDPOINT); None: no traces, no OTLP metrics."""
    service_name: str = "sluice"
    """OTel resource service.name (OTEL_SERVICE_NAME)."""
    tenant_label_cap: int = 100
    """Tenants that get their own label value on counters; later ones count as "other"."""
    tenant_label: TenantLabel = TenantLabel.ID
    """What that label value is: the tenant's id, its name, or "none" for all."""
    metrics_export_interval_s: float = 10.0
    """How often OTLP metrics are pushed."""


class Observability:
    def __init__(
        self,
        config: ObservabilityConfig,
        registry: CollectorRegistry,
        nodes: Callable[[], NodesReport],
        tracer: RequestTracer | None = None,
    ) -> None:
        self.config = config
        mirror = None
        if config.otlp_endpoint:
            mirror = OtlpMirror(config.otlp_endpoint, nodes, config.service_name, config.metrics_export_interval_s)
        self.metrics = ServingMetrics(registry, config.tenant_label_cap, mirror, config.tenant_label)
        self.by_length = LengthLatencyView()  # TTFT / ITL by token length per minute: the console's view
        registry.register(NodeCollector(nodes))
        self.tracer = tracer or RequestTracer.create(config.otlp_endpoint, config.service_name)

    def start(
        self,
        request_id: str,
        model: str,
        operation: str,
        requests: list[GenerationRequest],
        tenant: str | None,
        trace_parent: str | None,
        arrived: float | None = None,
    ) -> RequestTimeline:
        """`arrived`: time.time() when the request reached the gateway (default: now), where its
        TTFT, duration and trace start."""
        first = requests[0]
        timeline = RequestTimeline(
            request_id=request_id,
            model=model,
            operation=operation,
            tenant=tenant,
            trace_parent=trace_parent,
            choices=[ChoiceTimeline(priority=r.priority) for r in requests],
            started=time.time() if arrived is None else arrived,
            max_tokens=first.max_tokens,
            temperature=first.temperature,
        )
        if self.tracer is not None:
            self.tracer.plan(timeline)
        return timeline

    def finish(self, timeline: RequestTimeline, outcome: str) -> dict[str, object]:
        """Record metrics and the trace; returns fields for the request's log line."""
        ended = time.time()
        self.metrics.observe(timeline, outcome, ended)
        self.by_length.observe(timeline)
        fields: dict[str, object] = {"node": ",".join(sorted({c.node for c in timeline.choices if c.node}))}
        if self.tracer is not None:
            fields["trace_id"] = self.tracer.record(timeline, outcome, ended)
        return fields

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()
        if self.metrics.mirror is not None:
            self.metrics.mirror.shutdown()


# The incoming request's W3C traceparent header, set by the route handler; read when the request's
# timeline starts (in the handler's task, so the value is that request's).
TRACE_PARENT: ContextVar[str | None] = ContextVar("sluice_trace_parent", default=None)
