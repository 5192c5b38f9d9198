"""OpenAI wire format: request bodies the gateway accepts and the bodies it returns.

Unknown request fields are ignored (msgspec's default), as OpenAI clients send
extras freely; the OpenAI fields that would change the answer and that Sluice does not
implement (tools, a JSON response format, best_of) are declared here so that
`gateway.validation` refuses them with a 400 naming the field instead of answering as if
they were not there. Every optional field takes `null` for its default, as OpenAI's do
(clients that serialize every key send them). Range checks that msgspec can express live here as `Meta`
constraints, so a decode error already names the offending field and the OpenAPI
schema states the same bounds; checks that need the model (context length,
vocabulary) live in `gateway.validation` and the drivers.

Every number and string a client sends is bounded here, before it reaches the
engine pipe (msgpack carries integers in [-2**63, 2**64)), a torch.Generator or
a database column: an unbounded field is a 500 waiting to happen. JSON has no
NaN or Infinity, and a float literal too large for a double is refused by the
decoder, so every float that passes is finite.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEXT_CHARS = 1 << 22
"""Longest prompt, message content or suffix, in characters; the body cap (SLUICE_MAX_BODY_BYTES,
1 MiB by default) usually refuses such a body first."""
MAX_MESSAGES = 4096
MAX_PROMPT_ITEMS = 1 << 20
"""Longest prompt list: token ids, or prompts of a batch."""
MAX_STOP_CHARS = 256
"""Longest stop string; a stream holds back this many characters while it might be a stop string's start."""
MAX_MODEL_NAME_CHARS = 200
"""Model names are stored with each usage record (a VARCHAR(200) column)."""
MAX_NAME_CHARS = 256
"""A message's `name` and the end-user id `user`."""
MAX_LOGIT_BIAS = 1024
"""Most tokens one `logit_bias` may name."""

Role = Literal["system", "user", "assistant", "developer", "tool"]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Meta(max_length=4)]
N = Annotated[int, Meta(ge=1, le=8)]
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
"""A signed 64-bit seed. Choice i of a request samples with seed + i: at most 2**63 - 1 plus the number
of choices, inside what torch.Generator.manual_seed and msgpack take (below 2**64)."""
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
"""Below 2**31; whether the model's vocabulary has it is checked by the driver."""
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
"""A logit_bias value, OpenAI's range."""


class TextPart(msgspec.Struct, frozen=True):
    text: Text
    type: Literal["text"] = "text"


class Message(msgspec.Struct, frozen=True):
    role: Role
    content: Text | Annotated[list[TextPart], Meta(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool | None = None  # None: false


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields chat and legacy completions share."""

    model: Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_NAME_CHARS)] | None = None  # None: the first served model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    n: N | None = None  # None: 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    stream: bool | None = None  # None: false
    stream_options: StreamOptions | None = None
    user: Name | None = None  # accepted for OpenAI compatibility; not used
    ignore_eos: bool | None = None  # vLLM extension, used by benchmarks; None: false
    # vLLM extension: lower = more important. With auth it can only lower importance below the tenant's
    # tier (the larger of the two wins); with --no-auth it is used as is. Default: the tier (0 without auth).
    priority: Annotated[int, Meta(ge=0, le=1000)] | None = None
    # Token id (as a string, OpenAI's form) -> added to its logit before sampling; -100 bans it.
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    # Not implemented: accepted only as its no-op value (gateway.validation._refuse_unsupported).
    response_format: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None  # None: false
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # Not implemented: accepted only as their no-op values (gateway.validation.chat_plan).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


# A completion prompt: text, token ids, or a batch of either. msgspec cannot tell list[int] from
# list[str] in a union, so elements are checked in `gateway.validation`.
PromptElement = Text | TokenId | Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_ITEMS)]


class CompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    prompt: Text | Annotated[list[PromptElement], Meta(min_length=1, max_length=MAX_PROMPT_ITEMS)]
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool | None = None  # None: false; true is refused (not implemented)
    suffix: Text | None = None
    best_of: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None  # only best_of == n is served


# -- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int  # prompt tokens the engine served from its prefix cache


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # only when the engine reports a cache hit count


class TopLogprobOut(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[TokenLogprobOut]


class CompletionLogprobs(msgspec.Struct, frozen=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ResponseMessage(msgspec.Struct, frozen=True):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None  # the serving model version's (docs/versions.md); None outside the registry


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last chunk, when stream_options.include_usage
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Both the whole `text_completion` and each streamed chunk (OpenAI uses one object type)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always on the whole object; on a stream only in the usage chunk
    system_fingerprint: str | None = None


class ModelObject(msgspec.Struct, frozen=True):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    object: str = "model"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelObject]
    object: str = "list"


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


JSONObject = dict[str, Any]
