"""Turning a decoded OpenAI body into driver requests, with every check done before dispatch.

Two steps, cheap first:

    chat_plan / completion_plan   model exists, options supported (an OpenAI option Sluice does not
                                  implement is a 400 naming it, never ignored), prompt not longer
                                  than the context can hold at MAX_BYTES_PER_TOKEN (no tokenizing) -> Plan
    Plan.tokenize(driver)         each distinct prompt tokenized once, off the event loop; not empty;
                                  prompt + max_tokens fit the context; one request per choice    -> Dispatch

Shape and range checks are already done by the schemas. The choices of one prompt share its
token ids (`GenerationRequest.tokenized_prompt`), so the driver never tokenizes again.
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
from gateway.schemas import INT32_MAX, ChatCompletionRequest, CompletionRequest

# No tokenizer we serve puts more than this many bytes of text into one token (SmolLM2's longest
# token is 81 bytes), so a prompt of more characters than max_model_len x this can never fit the
# context: it is refused before the tokenizer spends up to a second on it.
MAX_BYTES_PER_TOKEN = 128

# The legacy completions API's max_tokens when the request omits it (OpenAI's documented default, and
# vLLM's); chat completions run up to the context, within the gateway's cap (Settings.max_default_tokens).
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Dispatch:
    """What to send to the driver for one API request: one GenerationRequest per choice."""

    request_id: str  # the API request's id; driver requests are `<id>-<i>` when there are several
    model: str
    requests: list[GenerationRequest]  # choice index = prompt index * n + i, as OpenAI orders them
    prompt_lengths: list[int]  # tokens of each distinct prompt
    n: int  # choices per prompt
    logprobs: int | None

    @property
    def prompt_tokens(self) -> int:
        """Summed over distinct prompts: the n choices of a prompt share it."""
        return sum(self.prompt_lengths)

    def prompt_of(self, choice: int) -> int:
        return choice // self.n


@dataclass(frozen=True)
class Plan:
    """A request that passed every check short of tokenizing: one template per distinct prompt."""

    request_id: str
    card: ModelCard
    prompts: list[GenerationRequest]
    max_tokens: int | None
    prompt_name: Literal["messages", "prompt"]
    n: int
    seed: int | None
    logprobs: int | None
    default_max_tokens: int | None = None  # the API's own default for an omitted max_tokens; None: none

    async def tokenize(self, driver: Driver, default_cap: int) -> Dispatch:
        """Tokenize each distinct prompt once and check that it fits with its completion budget."""
        if self.default_max_tokens is not None:
            default_cap = min(default_cap, self.default_max_tokens)
        ready: list[GenerationRequest] = []
        lengths: list[int] = []
        seen: dict[str, list[int]] = {}  # a batch may repeat a text prompt: tokenize it once
        for prompt in self.prompts:
            key = prompt.prompt
            ids = seen.get(key) if key is not None else None
            if ids is None:
                ids = await driver.tokenize(prompt)
                if key is not None:
                    seen[key] = ids
            if not ids:  # "" with a tokenizer that adds no BOS: nothing to continue from
                raise InvalidRequestError(f"The {self.prompt_name} is empty once tokenized.", self.prompt_name)
            budget = _completion_budget(self.card, len(ids), self.max_tokens, default_cap, self.prompt_name)
            ready.append(msgspec.structs.replace(prompt, max_tokens=budget, tokenized_prompt=ids))
            lengths.append(len(ids))
        requests = _fan_out(ready, self.n, self.seed)
        return Dispatch(self.request_id, self.card.id, requests, lengths, self.n, self.logprobs)


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


def chat_plan(body: ChatCompletionRequest, request_id: str, driver: Driver) -> Plan:
    card = resolve_model(driver, body.model)
    _refuse_unsupported(body)
    if body.tools:
        raise InvalidRequestError("tools (function calling) are not supported", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice is not supported: no tools can be given", "tool_choice")
    if body.functions:
        raise InvalidRequestError("functions (function calling) are not supported", "functions")
    if body.function_call not in (None, "none", "auto"):
        raise InvalidRequestError("function_call is not supported: no functions can be given", "function_call")
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
    _check_length(card, sum(len(m.content) for m in messages), "messages")
    template = msgspec.structs.replace(_base_request(body, request_id, card.id, logprobs), messages=messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return Plan(request_id, card, [template], max_tokens, "messages", body.n or 1, body.seed, logprobs)


def completion_plan(body: CompletionRequest, request_id: str, driver: Driver) -> Plan:
    card = resolve_model(driver, body.model)
    _refuse_unsupported(body)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidRequestError("best_of is not supported unless it equals n", "best_of")
    if body.echo:
        raise InvalidRequestError("echo is not supported", "echo")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", "suffix")
    base = _base_request(body, request_id, card.id, body.logprobs)
    prompts: list[GenerationRequest] = []
    for prompt in _split_prompt(body.prompt):
        if isinstance(prompt, str):
            _check_length(card, len(prompt), "prompt")
            prompts.append(msgspec.structs.replace(base, prompt=prompt))
        else:
            prompts.append(msgspec.structs.replace(base, prompt_token_ids=prompt))
    return Plan(request_id, card, prompts, body.max_tokens, "prompt", body.n or 1, body.seed, body.logprobs,
                default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """The OpenAI options both endpoints share that Sluice does not implement: a 400 naming the option
    unless it is given as its no-op value, rather than an answer that ignored it."""
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise InvalidRequestError("response_format other than text (JSON mode, JSON schemas) is not supported",
                                  "response_format")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")


def _check_length(card: ModelCard, characters: int, prompt_name: Literal["messages", "prompt"]) -> None:
    """Refuse, without tokenizing, a prompt too long for the context whatever its tokens.

    Characters, not bytes: there are never more of them than bytes, and len() costs nothing."""
    if card.max_model_len <= 0:
        return  # not known yet: the model is loading, and tokenize() says so
    limit = card.max_model_len * MAX_BYTES_PER_TOKEN
    if characters > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {card.max_model_len} tokens. However, your "
            f"{prompt_name} is {characters} characters long, more than that context can hold "
            f"({limit} characters at most). Please reduce the length of the {prompt_name}.",
            prompt_name,
        )


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
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        logit_bias=_logit_bias(body.logit_bias),
        priority=body.priority or 0,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids (whether the vocabulary has them is the engine's check)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > INT32_MAX:  # int() of no huge text
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
        out[int(key)] = value
    return out


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
        budget = min(room, default_cap)
        if card.max_request_tokens is not None:  # the default shrinks to what the KV pool can hold
            budget = min(budget, max(1, card.max_request_tokens - prompt_tokens))
    elif max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {card.max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_name}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_name} or completion.",
            "max_tokens",
        )
    else:
        budget = max_tokens
    if card.max_request_tokens is not None and prompt_tokens + budget > card.max_request_tokens:
        raise InvalidRequestError(
            f"This server's KV cache holds {card.max_request_tokens} tokens per request. However, you "
            f"requested {prompt_tokens + budget} tokens ({prompt_tokens} in the {prompt_name}, {budget} in the "
            f"completion). Please reduce the length of the {prompt_name} or completion.",
            "max_tokens" if max_tokens is not None else prompt_name,
        )
    return budget


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
