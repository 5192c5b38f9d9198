"""What one API request went through, gathered from its chunks as they stream: the input of the
request metrics and the trace. Recording is a few attribute writes per chunk; all the work happens
once, when the request ends (`observability.hub.Observability.finish`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drivers.base import GenerationChunk


@dataclass
class ChoiceTimeline:
    """One driver request (one choice): its node, token times and the engine's timestamps."""

    priority: int = 0
    span_id: int | None = None  # of this choice's span, chosen up front so a worker's span can name it
    node: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None  # time.time() of the first token
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between consecutive tokens, seconds
    # Per chunk with an engine token time: from the engine making its last token to the gateway taking the
    # chunk for the response (the engine pipe, the event loop's backlog), seconds.
    delivery: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # From the final chunk (the engine's own clock, time.time()):
    arrival: float | None = None
    scheduled: float | None = None
    engine_first_token: float | None = None
    finished: float | None = None
    preemption_times: list[float] = field(default_factory=list)

    def add(self, chunk: GenerationChunk) -> None:
        self.node = chunk.node_id or self.node
        self.prompt_tokens = chunk.prompt_tokens
        new = chunk.completion_tokens - self.completion_tokens
        self.completion_tokens = chunk.completion_tokens
        if new > 0:
            t = chunk.token_time
            if t is None:
                t = time.time()
            else:
                self.delivery.append(max(0.0, time.time() - t))
            if self.last_token is None:
                self.first_token = t
                new -= 1  # the first token has no gap before it
            if new > 0 and self.last_token is not None:
                gap = (t - self.last_token) / new  # a chunk of k tokens: k equal gaps
                self.itl.extend([gap] * new)
            self.last_token = t
        if chunk.finish_reason is not None:
            self.finish_reason = str(chunk.finish_reason)
            self.arrival = chunk.arrival_time
            self.scheduled = chunk.first_scheduled_time
            self.engine_first_token = chunk.first_token_time
            self.finished = chunk.finish_time
            self.preemption_times = list(chunk.preemption_times)


@dataclass
class RequestTimeline:
    request_id: str
    model: str
    operation: str  # "chat" | "text_completion" (gen_ai.operation.name)
    tenant: str | None
    trace_parent: str | None  # the incoming W3C traceparent header
    choices: list[ChoiceTimeline]
    # time.time() of the request's arrival at the gateway (before its body was read or its key
    # checked): TTFT and duration count from here; each choice keeps the engine's own timestamps
    # (arrival in the engine, first scheduled, first token, finished) for the queue/prefill/decode split.
    started: float = field(default_factory=time.time)
    max_tokens: int | None = None
    temperature: float | None = None
    # Chosen when the request starts (tracing on): the trace, and each choice's span id, exist before
    # the spans are recorded, so the traceparent a driver sends downstream names them.
    trace_id: int | None = None
    trace_flags: int = 1

    def downstream_trace_parent(self, index: int) -> str | None:
        """The W3C traceparent a driver sends for choice `index`: this trace, that choice's span."""
        span = self.choices[index].span_id
        if self.trace_id is None or span is None:
            return None
        return f"00-{self.trace_id:032x}-{span:016x}-{self.trace_flags:02x}"

    def add(self, index: int, chunk: GenerationChunk) -> None:
        self.choices[index].add(chunk)
