"""Typed messages on the wire between an engine process and its clients (msgspec).

Client -> engine: AddRequest, AbortRequest, SetFault (chaos testing), Shutdown.
Engine -> client: StepOutputs (every step that produced something) and
EngineStats (after steps and periodically when idle), AddRejected when a
request could not be queued, EngineReady once the model is loaded, and
EngineFailed before the process exits on an error.

Reasons cross as enums (`FinishReason`, `RejectReason`), never as bare ints or flags.
This module imports no torch: the gateway process decodes these.
"""

from __future__ import annotations

import enum

import msgspec

from engine_native.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended; on the wire as its int."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the context length
    ABORT = 2  # aborted by the client


class RejectReason(enum.StrEnum):
    """Why an AddRequest was not queued."""

    QUEUE_FULL = "queue_full"  # at a bound of the waiting queue: retry later
    INVALID = "invalid"  # the request can never run as sent


class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float
    tenant_id: str | None = None
    tenant_weight: float = 1.0  # fair-share weight of the tenant within its priority (fair_queue.py)
    # The driver was still tokenizing other requests when it sent this one: the rest of a burst is on its way
    # (an idle engine holds its first step for it: SchedulerConfig.burst_hold_s).
    more_coming: bool = False


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class SetFault(msgspec.Struct, tag="fault", kw_only=True):
    """Fault injection for chaos testing; replaces the previous setting. All zero/False: no fault."""

    step_delay_s: float = 0.0  # sleep this long after every step (a slow node)
    stall: bool = False  # stop stepping but keep every request (a hung node that still answers)


ClientMessage = AddRequest | AbortRequest | SetFault | Shutdown


class LogprobTop(msgspec.Struct, array_like=True):
    token_id: int
    token: str
    logprob: float


class LogprobEntry(msgspec.Struct, array_like=True):
    token_id: int
    token: str
    logprob: float
    top: list[LogprobTop]


class RequestOutput(msgspec.Struct, kw_only=True):
    """New output of one request from one step; `finish_reason` is set on its last output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    token_time: float  # when this step's token was produced
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[LogprobEntry] | None = None
    # Set on the final output only.
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    preemption_times: list[float] = []
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (usage's cached_tokens)


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutput]


class AddRejected(msgspec.Struct, tag="rejected", kw_only=True):
    request_id: str
    reason: RejectReason
    message: str


class EngineStats(msgspec.Struct, tag="stats", kw_only=True):
    node_id: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_prefill_chunks: int
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens looked up, since start
    prompt_tokens_total: int
    generation_tokens_total: int
    generation_tokens_per_s: float  # over the recent window
    steps: int
    timestamp: float
    # Prompt tokens served per second over the recent window: computed, or found in the prefix cache when
    # their request was admitted (the unit every queue of prompt tokens here is counted in).
    prompt_tokens_per_s: float = 0.0
    waiting_tokens: int = 0  # what SchedulerConfig.max_waiting_tokens bounds
    # Tokens the waiting requests still have to compute (rest of the prompt + max_tokens not yet
    # generated), by priority: the work a new request of priority p waits behind is that of p' <= p.
    waiting_work_by_priority: dict[int, int] = {}
    # What a new request's first token waits on: prompt tokens (and recomputed outputs) not yet served of
    # waiting requests by priority (whole: their prefix cache lookup comes when they are admitted), those
    # of running requests still in prefill (ahead of every waiting one; their cached prefix was served when
    # they were admitted), and how fast prompt tokens were served, computed or found cached, while such
    # work was queued (0: not measured).
    prefill_waiting_by_priority: dict[int, int] = {}
    prefill_running: int = 0
    prefill_tokens_per_s: float = 0.0
    max_waiting: int = 0
    max_waiting_tokens: int | None = None
    # Tensor-parallel engines only (0 otherwise), since start, on rank 0: seconds in the runner (the
    # forward, its collectives and sampling) and, of those, in collectives (the step broadcast and the
    # all-reduces, waits for slower ranks included): compute = forward - collective.
    forward_s_total: float = 0.0
    collective_s_total: float = 0.0
    collective_bytes_total: int = 0


class EngineReady(msgspec.Struct, tag="ready", kw_only=True):
    node_id: str
    model_name: str
    max_model_len: int
    kv_blocks_total: int
    block_size: int
    device: str = "cpu"  # e.g. "cuda:0 (NVIDIA H200)"
    attention_backend: str = "native"  # model/attention_backends.py


class EngineFailed(msgspec.Struct, tag="failed"):
    error: str


EngineMessage = StepOutputs | AddRejected | EngineStats | EngineReady | EngineFailed
