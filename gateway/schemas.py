"""OpenAI wire format: request bodies the gateway accepts and the bodies it returns.

Unknown request fields are ignored (msgspec's default), as OpenAI clients send
extras freely. Range checks that msgspec can express live here as `Meta`
constraints, so a decode error already names the offending field; checks that
need the model (context length) live in `gateway.validation`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Role = Literal["system", "user", "assistant", "developer", "tool"]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopList = Annotated[list[str], Meta(max_length=4)]
N = Annotated[int, Meta(ge=1, le=8)]
MaxTokens = Annotated[int, Meta(ge=1)]


class TextPart(msgspec.Struct, frozen=True):
    text: str
    type: Literal["text"] = "text"


class Message(msgspec.Struct, frozen=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields chat and legacy completions share."""

    model: str | None = None  # None: the first served model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    stop: str | StopList | None = None
    seed: int | None = None
    n: N = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension, used by benchmarks
    # vLLM extension: lower = more important. With auth it can only lower importance below the tenant's
    # tier (the larger of the two wins); with --no-auth it is used as is. Default: the tier (0 without auth).
    priority: Annotated[int, Meta(ge=0, le=1000)] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


# A completion prompt: text, token ids, or a batch of either. msgspec cannot tell list[int] from
# list[str] in a union, so elements are checked in `gateway.validation`.
PromptElement = str | int | list[int]


class CompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    prompt: str | Annotated[list[PromptElement], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None


# -- responses -----------------------------------------------------------------------------------


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
