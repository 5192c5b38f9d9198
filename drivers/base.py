"""The one door between the HTTP world and any engine.

A driver turns a `GenerationRequest` into an async stream of
`GenerationChunk`s. Every engine (the native one, SGLang over HTTP, the
synthetic load generator) is a `Driver`; the gateway never knows which.

Errors cross this seam as the typed exceptions below and are mapped to HTTP
in one place (`gateway.errors`). A driver raises them either from
`generate()` before the first chunk (bad request, overloaded, model unknown)
or mid-stream (engine died).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from drivers.portable_tokenizer import TokenizerSpec


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled (client gone, shutdown)


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One completion to produce. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str
    model: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: sampled token's logprob plus top N alternatives
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling, in [-100, 100]
    priority: int = 0  # lower value = more important (tier 0 is the highest)
    tenant_id: str | None = None
    # The prompt as the engine sees it (token ids after the chat template and BOS), from
    # `Driver.tokenize`. The gateway sets it so that `generate()` never tokenizes again (the choices
    # of one prompt share it); None: `generate()` tokenizes the prompt itself.
    tokenized_prompt: list[int] | None = None
    # The tenant's fair-share weight within its tier (TenantContext.weight): weight 2 gets twice the
    # tokens of weight 1 when both have work waiting. Must be > 0.
    tenant_weight: float = 1.0
    # How many trailing ids of `tokenized_prompt` are output the client already has: a request the
    # fleet resumes on another worker after its first one failed mid-stream (drivers/fleet). The
    # driver renders the new text in their context (a leading space, a merge) as if it had never
    # stopped; 0: a fresh request.
    resumed_output_tokens: int = 0
    # W3C traceparent of the gateway's span for this choice (set only when tracing is on): a driver
    # that crosses a process boundary sends it along (the fleet: the `traceparent` header to a worker).
    trace_parent: str | None = None


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class GenerationChunk(msgspec.Struct, frozen=True, kw_only=True):
    """New output of one request since its previous chunk.

    `text` never ends inside a UTF-8 character; stop strings are already cut.
    `prompt_tokens` and `completion_tokens` are running totals.
    """

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    # Timestamps (time.time()) the engine recorded; filled on the final chunk.
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    node_id: str | None = None
    # When this chunk's last token was produced (time.time()); per-token latency comes from these.
    token_time: float | None = None
    # Final chunk: when the engine preempted (and later recomputed) the request.
    preemption_times: list[float] = []
    # Final chunk: prompt tokens the engine served from its prefix cache (usage's
    # prompt_tokens_details.cached_tokens); None: the engine does not say (the native engine and SGLang do).
    cached_tokens: int | None = None


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    max_model_len: int
    owned_by: str = "sluice"
    created: int = 0
    # The most tokens (prompt + completion) one request can hold in the engine's KV pool when that is
    # less than max_model_len; None: max_model_len. A request beyond it could never run (it must fit
    # the pool alone), so the gateway refuses it up front (400) rather than queueing it.
    max_request_tokens: int | None = None


class DriverHealth(msgspec.Struct, frozen=True):
    ready: bool  # can serve a request now (/readyz): some engine is up
    detail: str = ""
    # Not ready yet but capacity is coming (a model loading, a first worker starting): the gateway holds
    # requests meanwhile (gateway/cold_start.py). False when not ready because something broke (an engine
    # died and restarts, the driver stopped): then requests fail fast.
    starting: bool = False
    # False once the driver gave up (an engine in a crash loop): only a restart of the process helps,
    # so /healthz fails and an orchestrator restarts it.
    live: bool = True
    degraded: bool = False  # ready, but some engines are down (restarting) or given up on
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    preemptions: int = 0
    generation_tokens_per_s: float = 0.0
    # What admission control (gateway.load_shedding) estimates queue waits from. Drivers that do not
    # know a figure leave its default; 0 throughput means "not measured yet".
    # Prompt tokens served per second, recently: computed, or found in the prefix cache. The queues below
    # count whole prompts, so the rate counts cached tokens too (the recent hit ratio is folded into it).
    prompt_tokens_per_s: float = 0.0
    waiting_tokens: int = 0  # tokens queued (what max_waiting_tokens bounds)
    # Tokens the waiting requests still have to compute (prompt + max_tokens left), by priority.
    waiting_work_by_priority: dict[int, int] = {}
    # What a first token waits on below the running cap (gateway.load_shedding): prompt tokens not yet
    # served of queued requests by priority, of running requests still in prefill, and how fast prompt
    # tokens were served (computed or found in the prefix cache) while such work was queued (0: not measured).
    prefill_waiting_by_priority: dict[int, int] = {}
    prefill_running: int = 0
    prefill_tokens_per_s: float = 0.0
    max_waiting: int = 0  # bound of the waiting queue in requests; 0: unknown
    max_num_seqs: int = 0  # cap on running sequences (all engines); 0: unknown
    max_waiting_tokens: int = 0  # bound of the waiting queue in tokens; 0: unknown or none
    prefix_cache_hit_rate: float = 0.0
    timestamp: float = 0.0  # time.time() of the engine's figures; 0: now


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One engine node as `GET /admin/nodes` shows it: load, recent latency and health verdict."""

    id: str
    status: str  # "healthy" | "sluggish" | "stalled" | "dead"
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_per_s: float = 0.0
    itl_p50_ms: float | None = None  # over the health window
    itl_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    reason: str | None = None  # why it is not healthy
    since: float | None = None  # time.time() of the last status change
    preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    score: float | None = None  # latency / peers' at comparable load; None: not enough samples
    step_delay_s: float = 0.0  # injected fault, if any
    stalled_by_fault: bool = False
    restarts: int = 0  # times its engine was restarted after dying
    # Tensor-parallel engines (0 otherwise), since start: seconds in the forward, and of those in
    # collectives (engine_native/parallel, docs/parallelism.md).
    forward_seconds: float = 0.0
    collective_seconds: float = 0.0
    device: str | None = None  # where its engine computes ("cpu", "cuda:0 (NVIDIA H200)"); None: not reported
    attention_backend: str | None = None  # its engine's paged attention ("native", "sdpa", "flashinfer")
    # Fleet workers (drivers/fleet): where it is, its membership state and incarnation, its circuit.
    address: str | None = None
    state: str | None = None  # "joining" | "ready" | "draining"
    incarnation: int | None = None
    circuit: str | None = None  # "closed" | "open" | "half_open"
    in_flight: int = 0  # streams this gateway has open on it
    requests: int = 0  # attempts this gateway sent it (a failed-over request counts on each worker)
    errors: int = 0  # of those, lost: connection refused, stream cut, stalled or timed out
    failovers: int = 0  # requests moved off it to another worker after a failure here
    # SGLang servers: KV pool in use as a fraction (from its /metrics), and where its load figures come from
    kv_usage: float | None = None
    load_source: str | None = None  # "/get_load" | "/metrics" | "" (neither: only this gateway's streams count)


class NodeEvent(msgspec.Struct, frozen=True):
    time: float
    node: str
    kind: str  # "flagged" | "unflagged" | "stalled" | "recovered" | "restarted"
    reason: str


def milliseconds(seconds: float | None) -> float | None:
    """A latency in seconds as NodeInfo's milliseconds (3 decimals); None stays None."""
    return round(seconds * 1000, 3) if seconds is not None else None


class NodesReport(msgspec.Struct, frozen=True):
    nodes: list[NodeInfo]
    events: list[NodeEvent]


class DriverError(Exception):
    """Base of every error a driver raises across the seam."""


class InvalidRequestError(DriverError):
    """The request can never succeed as sent (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(DriverError):
    """No served model has this name (404)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist")
        self.model = model


class OverloadedError(DriverError):
    """The engine cannot take the request now; the client should retry after `retry_after` seconds (503)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(OverloadedError):
    """The server is draining or stopping: the request was not taken, or was ended before it finished
    (503 + Retry-After: another replica, or this one once restarted, can serve it)."""


class EngineDeadError(DriverError):
    """The engine process is gone; requests fail fast (503) until it is restarted."""


class Driver(ABC):
    """Implementations are registered by name in `drivers.registry`."""

    def begin_start(self) -> None:
        """Begin what `start()` does that needs no event loop, so that it runs while the caller goes on
        (`sluice serve` calls it before importing the gateway): the native driver spawns its engine
        processes. Optional; `start()` completes it. Default: nothing."""

    @abstractmethod
    async def start(self) -> None:
        """Load models / connect. Called once before the first request."""

    @abstractmethod
    async def stop(self) -> None:
        """Abort in-flight requests and release every resource."""

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the request's output. Closing the iterator early (client gone) must abort the
        request in the engine, so implementations abort in their `finally`."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Cancel a request; a no-op when it already finished."""

    @abstractmethod
    async def health(self) -> DriverHealth: ...

    @abstractmethod
    def models(self) -> list[ModelCard]: ...

    def nodes(self) -> NodesReport:
        """The engine nodes behind this driver, their health and recent transitions."""
        return NodesReport([], [])

    async def set_fault(self, node_id: str, step_delay_s: float, stall: bool) -> None:
        """Chaos testing: slow down (extra delay per engine step) or stall one node; zeros clear it."""
        raise InvalidRequestError(f"{type(self).__name__} does not support fault injection")

    def tokenizer_spec(self, model: str) -> TokenizerSpec | None:
        """The model's prompt tokenizer as a message (drivers/portable_tokenizer.py), for a fleet
        gateway to tokenize with; None: prompts must be tokenized here (`tokenize`)."""
        return None

    @abstractmethod
    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt as the engine will see it: token ids after the chat template and BOS.

        Raises InvalidRequestError, ModelNotFoundError, or OverloadedError while the model loads.
        The tokenizer runs off the event loop (a worker thread), because a long prompt takes up to
        a second to encode and would stall every other stream meanwhile. The gateway calls this
        once per distinct prompt before dispatch, to check and charge lengths, and hands the ids to
        `generate()` in `GenerationRequest.tokenized_prompt`, so a prompt is never tokenized twice.
        """
