"""The gateway <-> worker wire: msgspec Structs, JSON bodies, one JSON line per stream event.

    POST /fleet/v1/tokenize   TokenizeRequest  -> TokenizeResponse
    POST /fleet/v1/generate   SubmitRequest    -> 200, lines of StreamEvent (TokensEvent | KeepAlive
                                                  | FailureEvent), or a 4xx/5xx ErrorBody before any
    GET  /fleet/v1/info                        -> WorkerInfo
    GET  /fleet/v1/tokenizer?model=M           -> TokenizerSpec (drivers/portable_tokenizer.py), or
                                                  404 ErrorBody when the model's does not travel

Every request carries `authorization: Bearer <fleet secret>` when the fleet has one. Closing the
generate stream aborts the request on the worker. A stream ends with a TokensEvent whose
`finish_reason` is set, or a FailureEvent; a stream that just stops means the worker is lost.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from drivers.base import ChatMessage, FinishReason, ModelCard, TokenLogprob

GENERATE_PATH = "/fleet/v1/generate"
TOKENIZE_PATH = "/fleet/v1/tokenize"
INFO_PATH = "/fleet/v1/info"
TOKENIZER_PATH = "/fleet/v1/tokenizer"


class WorkerState(enum.StrEnum):
    JOINING = "joining"  # up, model still loading: not routable
    READY = "ready"
    DRAINING = "draining"  # finishing what it has; takes nothing new


class ErrorKind(enum.StrEnum):
    """Why a worker refused or ended a request; the fleet driver maps each to the driver seam."""

    INVALID = "invalid"  # the request can never succeed (400): not retried elsewhere
    MODEL_NOT_FOUND = "model_not_found"  # 404: this worker does not serve it; another may
    OVERLOADED = "overloaded"  # 503: queue full here; another worker may take it
    SHUTTING_DOWN = "shutting_down"  # 503: draining or stopping; retry elsewhere
    ENGINE_DEAD = "engine_dead"  # 503: its engine is gone; retry elsewhere
    UNAUTHORIZED = "unauthorized"  # 401: wrong or missing fleet secret
    FENCED = "fenced"  # 409: the request was meant for another incarnation of this worker


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int
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
    logprobs: int | None = None
    logit_bias: dict[int, float] = {}


class SubmitRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One generation, already tokenized. A continuation after failover is the original prompt plus
    the tokens the client already has; `resumed_tokens` says how many of those trailing ids are
    output, so the worker's detokenizer renders the rest in context."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    priority: int = 0
    tenant_id: str | None = None  # also the salt of the tenant's prefix-cache blocks
    tenant_weight: float = 1.0
    resumed_tokens: int = 0
    deadline: float | None = None  # time.time() after which the worker gives up on it
    incarnation: int | None = None  # the worker incarnation the router chose; another one refuses (409)
    # The router's 63-bit hash of the prompt's first KV blocks: the worker lists it as held.
    prefix_key: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None


class TokenizeResponse(msgspec.Struct, frozen=True):
    token_ids: list[int]


class TokensEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="tokens"):
    """New tokens of the request; counts are running totals on this worker."""

    token_ids: list[int]
    text: str
    token_times: list[float]  # time.time() on the worker, one per token
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemption_times: list[float] = []
    cached_tokens: int | None = None  # prompt tokens this worker's prefix cache served (on the last event)


class KeepAlive(msgspec.Struct, frozen=True, tag="keepalive"):
    """Sent while the request waits or runs without a token: a live worker keeps talking, so silence
    longer than the stall timeout means a hung or cut-off worker."""

    time: float


class FailureEvent(msgspec.Struct, frozen=True, kw_only=True, tag="failure"):
    kind: ErrorKind
    message: str
    retry_after: float | None = None


StreamEvent = TokensEvent | KeepAlive | FailureEvent


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """A refused request (4xx / 503), before any stream event."""

    kind: ErrorKind
    message: str
    param: str | None = None
    retry_after: float | None = None


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """The load figures a worker publishes with every heartbeat."""

    running: int = 0
    waiting: int = 0
    in_flight: int = 0  # generate streams open on the worker
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    max_num_seqs: int = 0
    max_waiting: int = 0
    generation_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    prefix_cache_hit_rate: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class HeldPrefix(msgspec.Struct, frozen=True, array_like=True):
    """A prompt prefix whose KV blocks the worker's cache probably still holds (drivers/fleet/prefixes.py)."""

    key: int  # the router's prefix key (`router.prefix_key`)
    blocks: int  # KV blocks of the prompt it last came with
    idle_s: float  # since a request last brought it


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as the fleet knows it: its Redis record, and its GET /fleet/v1/info."""

    id: str
    address: str  # base URL the gateways reach it at
    state: WorkerState
    incarnation: int
    models: list[ModelCard] = []
    load: WorkerLoad = WorkerLoad()
    heartbeat_at: float = 0.0  # time.time() on the worker
    host: str = ""
    # Model id -> fingerprint of its prompt tokenizer, for those that travel: a gateway with the same
    # fingerprint tokenizes that model's prompts itself instead of asking (POST /fleet/v1/tokenize).
    tokenizers: dict[str, str] = {}
    # The prefixes its requests came with, most recent last, as many as its KV pool can keep.
    prefixes: list[HeldPrefix] = []


def encode_line(event: StreamEvent) -> bytes:
    return msgspec.json.encode(event) + b"\n"


STREAM_DECODER = msgspec.json.Decoder(StreamEvent)
INFO_DECODER = msgspec.json.Decoder(WorkerInfo)
ERROR_DECODER = msgspec.json.Decoder(ErrorBody)
