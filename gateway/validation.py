"""Turning a decoded OpenAI body into driver requests, with every check done before dispatch.

Checks that need the served model live here (model exists, prompt + max_tokens
fit the context); shape and range checks are already done by the schemas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from drivers.base import (
    ChatMessage,
    Driver,
    GenerationRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
)
from gateway.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Dispatch:
    """What to send to the driver for one API request: one GenerationRequest per choice."""

    request_id: str  # the API request's id; driver requests are `<id>-<i>` when there are several
    model: str
    requests: list[GenerationRequest]
    prompt_tokens: int  # summed over distinct prompts (a completion batch has several)
    logprobs: int | None


def resolve_model(driver: Driver, name: str | None) -> ModelCard:
    cards = driver.models()
    if name is None:
        if not cards:
            raise ModelNotFoundError("<none>")
        return cards[0]
    for card in cards:
        if card.id == name:
            return card
    raise ModelNotFoundError(name)


def chat_dispatch(body: ChatCompletionRequest, request_id: str, driver: Driver, default_cap: int) -> Dispatch:
    card = resolve_model(driver, body.model)
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
    template = msgspec.structs.replace(_base_request(body, request_id, card.id, logprobs), messages=messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt_tokens = driver.count_prompt_tokens(template)
    budget = _completion_budget(card, prompt_tokens, max_tokens, default_cap, "messages")
    template = msgspec.structs.replace(template, max_tokens=budget)
    return Dispatch(request_id, card.id, _fan_out([template], body.n, body.seed), prompt_tokens, logprobs)


def completion_dispatch(
    body: CompletionRequest, request_id: str, driver: Driver, default_cap: int
) -> Dispatch:
    card = resolve_model(driver, body.model)
    if body.echo:
        raise InvalidRequestError("echo is not supported", "echo")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", "suffix")
    base = _base_request(body, request_id, card.id, body.logprobs)
    prompts: list[GenerationRequest] = []
    total_prompt = 0
    for prompt in _split_prompt(body.prompt):
        one = (
            msgspec.structs.replace(base, prompt=prompt)
            if isinstance(prompt, str)
            else msgspec.structs.replace(base, prompt_token_ids=prompt)
        )
        count = driver.count_prompt_tokens(one)
        budget = _completion_budget(card, count, body.max_tokens, default_cap, "prompt")
        prompts.append(msgspec.structs.replace(one, max_tokens=budget))
        total_prompt += count
    return Dispatch(request_id, card.id, _fan_out(prompts, body.n, body.seed), total_prompt, body.logprobs)


def _base_request(
    body: ChatCompletionRequest | CompletionRequest, request_id: str, model: str, logprobs: int | None
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        model=model,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        priority=body.priority or 0,
    )


def _completion_budget(
    card: ModelCard,
    prompt_tokens: int,
    max_tokens: int | None,
    default_cap: int,
    prompt_name: Literal["messages", "prompt"],
) -> int:
    room = card.max_model_len - prompt_tokens
    if max_tokens is None:
        if room < 1:
            raise InvalidRequestError(
                f"This model's maximum context length is {card.max_model_len} tokens. However, your "
                f"{prompt_name} resulted in {prompt_tokens} tokens, leaving no room for the completion. "
                f"Please reduce the length of the {prompt_name}.",
                prompt_name,
            )
        return min(room, default_cap)
    if max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {card.max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_name}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_name} or completion.",
            "max_tokens",
        )
    return max_tokens


def _split_prompt(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """A completion prompt as a list of single prompts: text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, list) for p in prompt):
        batch = [p for p in prompt if isinstance(p, list)]
        if any(not ids for ids in batch):
            raise InvalidRequestError("A token-id prompt must not be empty", "prompt")
        return list(batch)
    raise InvalidRequestError("prompt must be a string, a list of token ids, or a list of either", "prompt")


def _fan_out(prompts: list[GenerationRequest], n: int, seed: int | None) -> list[GenerationRequest]:
    """One driver request per choice; choice index = prompt_index * n + i, as OpenAI orders them."""
    if len(prompts) == 1 and n == 1:
        return prompts
    out = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            out.append(
                msgspec.structs.replace(
                    prompt,
                    request_id=f"{prompt.request_id}-{index}",
                    seed=None if seed is None else seed + index,
                )
            )
    return out
