"""Token-level stop rules: EOS, `stop_token_ids` and `max_tokens`.

Stop *strings* live in `engine_native.detokenizer`, because they are a property
of the text, not of any single token.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from engine_native.sampling_params import SamplingParams

StopReason = Literal["stop", "length"]  # the names of `FinishReason` members, lower-cased


def check_stop_token(
    token_id: int, params: SamplingParams, eos_token_ids: Collection[int], num_output_tokens: int
) -> StopReason | None:
    """Why the request finishes after sampling `token_id`, or None to keep going.

    `num_output_tokens` counts `token_id` itself. A stop token wins over the
    length limit when both apply on the same step, as in OpenAI's API.
    """
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
