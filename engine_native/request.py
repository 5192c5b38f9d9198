"""An engine-side request: its tokens, its progress and its lifecycle.

Progress is a token count, not a phase. The token regions of a request:

    |<----------------------- num_tokens ------------------------>|
    |<-------- prompt_token_ids -------->|<-- output_token_ids -->|
    |<---- num_computed_tokens ---->|<--- still to compute --->|

Prefill, chunked prefill, decode (exactly one token left to compute: the
last sampled one) and recompute after preemption (num_computed_tokens reset
to 0, prompt and output recomputed together) all follow from that one rule:
each step computes some of `num_tokens - num_computed_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine_native.messages import FinishReason
from engine_native.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASON_OF_STATUS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower value = more important
    arrival_time: float = field(default_factory=time.time)
    tenant_id: str | None = None
    tenant_weight: float = 1.0  # fair-share weight of the tenant (fair_queue.FairShare)
    eos_token_ids: frozenset[int] = frozenset()

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # The most num_computed_tokens ever reached: a preemption resets num_computed_tokens, not this, so
    # the tokens recomputed up to here are not charged to the tenant's fair share a second time.
    max_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    preemption_times: list[float] = field(default_factory=list)  # time.time() of each, for traces
    num_prefill_chunks: int = 0  # steps that computed part of a prompt without sampling
    num_cached_prompt_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    generator: torch.Generator | None = None

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output without concatenating the whole history."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON_OF_STATUS.get(self.status)
