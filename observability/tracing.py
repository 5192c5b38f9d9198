"""OpenTelemetry traces: one per request, built when the request ends from its timeline.

    <operation> <model>           gateway span (SERVER), parent = the incoming W3C traceparent
      sluice.driver.generate      one per choice, from the engine's arrival to its finish time
        events: queued, scheduled, preempted (each), first_token, finished - at the engine's times
          sluice.worker.generate  (fleet) recorded by the `sluice worker` that ran the choice, in its
                                  own process, parent = the traceparent the fleet driver sent it

The trace id and each choice span's id are chosen when the request starts (`plan`), because a
worker needs its parent's ids while the request runs, long before the gateway records its spans;
the SDK is handed those ids through `_PlannedIds` when the spans are made.

Spans are created after the fact with explicit start/end times, so nothing on the token path
changes when tracing is on, and nothing at all happens when it is off: without an OTLP endpoint
(`OTEL_EXPORTER_OTLP_ENDPOINT`, read once at start into settings) `RequestTracer.create` returns
None and no SDK object exists. The tracer provider is ours, not the global one, so several apps
in one process (tests) do not share exporters.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from observability.timeline import ChoiceTimeline, RequestTimeline

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

_W3C_SAMPLED = 0x01


def _ns(t: float) -> int:
    return int(t * 1e9)


class _PlannedIds:
    """The SDK's id generator, answering with ids chosen earlier when there are some (set just
    before a span is started, on the one event-loop thread), random ones otherwise."""

    def __init__(self) -> None:
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generate_trace_id(self) -> int:
        planned, self.trace_id = self.trace_id, None
        return planned if planned is not None else random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True  # planned or not, every trace id is 128 random bits

    def generate_span_id(self) -> int:
        planned, self.span_id = self.span_id, None
        return planned if planned is not None else random.getrandbits(64) or 1


class RequestTracer:
    def __init__(self, provider: TracerProvider, ids: _PlannedIds | None = None) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._ids = ids or _PlannedIds()
        self._tracer = provider.get_tracer("sluice")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def create(
        cls, endpoint: str | None, service_name: str = "sluice", exporter: SpanExporter | None = None
    ) -> RequestTracer | None:
        """A tracer exporting to `endpoint` (OTLP/HTTP, `/v1/traces` appended) or to `exporter`;
        None when neither is given: tracing off."""
        if endpoint is None and exporter is None:
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=f"{str(endpoint).rstrip('/')}/v1/traces")
        ids = _PlannedIds()
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                  id_generator=ids)  # type: ignore[arg-type]  # duck-typed IdGenerator
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        return cls(provider, ids)

    def plan(self, t: RequestTimeline) -> None:
        """Choose the request's trace id (the caller's, from its traceparent, else a new one) and each
        choice span's id now, so that `RequestTimeline.downstream_trace_parent` can name them."""
        from opentelemetry import trace

        parent = trace.get_current_span(
            self._propagator.extract({"traceparent": t.trace_parent}) if t.trace_parent else None
        ).get_span_context()
        if parent.is_valid:
            t.trace_id, t.trace_flags = parent.trace_id, int(parent.trace_flags)
        else:
            t.trace_id, t.trace_flags = random.getrandbits(128) or 1, _W3C_SAMPLED
        for c in t.choices:
            c.span_id = random.getrandbits(64) or 1

    def record_remote(self, name: str, trace_parent: str | None, start: float, end: float,
                      attributes: dict[str, str | int | float], error: str | None = None) -> str:
        """One SERVER span of work done for another process's span (a worker's generate, parent =
        the gateway's traceparent header); returns its trace id (hex)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = self._propagator.extract({"traceparent": trace_parent}) if trace_parent else None
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=_ns(start),
                                       attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(max(start, end)))
        return format(span.get_span_context().trace_id, "032x")

    def record(self, t: RequestTimeline, outcome: str, ended: float) -> str:
        """Emit the request's spans; returns its trace id (hex) for the log line."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = self._propagator.extract({"traceparent": t.trace_parent}) if t.trace_parent else None
        prompt = sum(c.prompt_tokens for c in t.choices)
        completion = sum(c.completion_tokens for c in t.choices)
        attributes: dict[str, str | int | float | list[str]] = {
            "gen_ai.operation.name": t.operation,
            "gen_ai.system": "sluice",
            "gen_ai.request.model": t.model,
            "gen_ai.response.model": t.model,
            "gen_ai.response.id": t.request_id,
            "gen_ai.usage.input_tokens": prompt,
            "gen_ai.usage.output_tokens": completion,
            "gen_ai.response.finish_reasons": [c.finish_reason or "none" for c in t.choices],
            "sluice.request.id": t.request_id,
            "sluice.status": outcome,
        }
        if t.tenant is not None:
            attributes["sluice.tenant.id"] = t.tenant
        if t.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = t.max_tokens
        if t.temperature is not None:
            attributes["gen_ai.request.temperature"] = t.temperature
        self._ids.trace_id = t.trace_id  # used only without a parent: then the planned trace is new
        span = self._tracer.start_span(
            f"{t.operation} {t.model}", context=parent, kind=SpanKind.SERVER,
            start_time=_ns(t.started), attributes=attributes,
        )
        self._ids.trace_id = None  # not consumed when the caller's traceparent gave the trace
        if outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, outcome))
        inner = trace.set_span_in_context(span)
        for i, c in enumerate(t.choices):
            self._choice_span(inner, i, c, t.started, ended)
        span.end(end_time=_ns(ended))
        return format(span.get_span_context().trace_id, "032x")

    def _choice_span(self, context: object, index: int, c: ChoiceTimeline, started: float, ended: float) -> None:
        start = c.arrival if c.arrival is not None else started
        self._ids.span_id = c.span_id
        span = self._tracer.start_span(
            "sluice.driver.generate", context=context,  # type: ignore[arg-type]
            start_time=_ns(start),
            attributes={
                "sluice.node.id": c.node or "none",
                "sluice.choice.index": index,
                "sluice.priority": c.priority,
                "gen_ai.usage.input_tokens": c.prompt_tokens,
                "gen_ai.usage.output_tokens": c.completion_tokens,
                "sluice.preemptions": len(c.preemption_times),
            },
        )
        if c.arrival is not None:
            span.add_event("queued", timestamp=_ns(c.arrival))
        if c.scheduled is not None:
            span.add_event("scheduled", timestamp=_ns(c.scheduled))
        for n, when in enumerate(c.preemption_times, 1):
            span.add_event("preempted", {"sluice.preemption": n}, timestamp=_ns(when))
        first = c.engine_first_token or c.first_token
        if first is not None:
            span.add_event("first_token", timestamp=_ns(first))
        finish = c.finished or c.last_token or ended
        span.add_event("finished", {"gen_ai.response.finish_reasons": [c.finish_reason or "none"]},
                       timestamp=_ns(finish))
        span.end(end_time=_ns(max(finish, start)))

    def shutdown(self) -> None:
        self.provider.shutdown()
