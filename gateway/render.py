"""Driver output to OpenAI objects: whole responses, stream chunks, and SSE framing."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from drivers.base import GenerationChunk, TokenLogprob
from gateway.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    ErrorBody,
    ErrorDetail,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprobOut,
    TopLogprobOut,
    Usage,
)

SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


# Characters JSON may carry raw that line readers built on str.splitlines() (httpx's aiter_lines, many
# hand-written clients) take for line ends, splitting an event in two: U+0085, U+2028, U+2029.
# Generated text holds them now and then; written as JSON escapes they mean the same to every parser.
_LINE_BREAKING = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(obj: object) -> bytes:
    """One server-sent event, framed exactly `data: <json>\\n\\n`, on one line for any line reader."""
    data = _encoder.encode(obj)
    if not data.isascii():  # one scan per event; the three searches only for text beyond ASCII
        for raw, escaped in _LINE_BREAKING:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def sse_error(detail: ErrorDetail) -> bytes:
    return sse(ErrorBody(detail))


@dataclass
class ChoiceOutput:
    """Everything one choice produced, accumulated for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0

    def add(self, chunk: GenerationChunk) -> None:
        self.text.append(chunk.text)
        self.logprobs.extend(chunk.logprobs or [])
        self.completion_tokens = chunk.completion_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = str(chunk.finish_reason)


def _nothing_new(chunk: GenerationChunk, logprobs: bool) -> bool:
    """A chunk with no token, no text, no end and no logprobs to show gets no event.

    A token whose text is held back (a stop string may be forming, or it ends inside a UTF-8
    character) still gets its event, with empty text, as vLLM's server sends one: a client sees one
    event per token at the time the token was made. Skipped, the next event carried two tokens'
    text, and every such token doubled one inter-token gap a client measures (at 8 random-prompt
    streams, ~20 of ~4,000 gaps: half the rank of the p99).
    """
    return not chunk.token_ids and not chunk.text and chunk.finish_reason is None and not (logprobs and chunk.logprobs)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    details = PromptTokensDetails(cached_tokens) if cached_tokens is not None else None
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


def _chat_logprobs(items: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprobOut(
                t.token,
                t.logprob,
                t.bytes,
                [TopLogprobOut(a.token, a.logprob, a.bytes) for a in t.top_logprobs],
            )
            for t in items
        ]
    )


def _completion_logprobs(items: list[TokenLogprob], start_offset: int = 0) -> CompletionLogprobs:
    offsets, offset = [], start_offset
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(
        tokens=[t.token for t in items],
        token_logprobs=[t.logprob for t in items],
        top_logprobs=[{a.token: a.logprob for a in t.top_logprobs} for t in items],
        text_offset=offsets,
    )


def chat_completion(
    rid: str, created: int, model: str, outputs: list[ChoiceOutput], prompt_tokens: int, cached_tokens: int | None,
    logprobs: bool, fingerprint: str | None = None,
) -> ChatCompletion:
    choices = [
        ChatChoice(
            i,
            ResponseMessage("".join(o.text)),
            o.finish_reason,
            _chat_logprobs(o.logprobs) if logprobs else None,
        )
        for i, o in enumerate(outputs)
    ]
    completion = sum(o.completion_tokens for o in outputs)
    return ChatCompletion(
        id=rid, created=created, model=model, choices=choices, usage=usage(prompt_tokens, completion, cached_tokens),
        system_fingerprint=fingerprint,
    )


def text_completion(
    rid: str, created: int, model: str, outputs: list[ChoiceOutput], prompt_tokens: int, cached_tokens: int | None,
    logprobs: bool, fingerprint: str | None = None,
) -> Completion:
    choices = [
        CompletionChoice(
            i, "".join(o.text), o.finish_reason, _completion_logprobs(o.logprobs) if logprobs else None
        )
        for i, o in enumerate(outputs)
    ]
    completion = sum(o.completion_tokens for o in outputs)
    return Completion(
        id=rid,
        object="text_completion",
        created=created,
        model=model,
        choices=choices,
        usage=usage(prompt_tokens, completion, cached_tokens),
        system_fingerprint=fingerprint,
    )


@dataclass(frozen=True)
class ChatChunks:
    """Stream chunk builder for one chat completion."""

    rid: str
    created: int
    model: str
    fingerprint: str | None = None

    def _chunk(self, choices: list[ChatChunkChoice], use: Usage | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=self.rid,
                object="chat.completion.chunk",
                created=self.created,
                model=self.model,
                choices=choices,
                usage=use,
                system_fingerprint=self.fingerprint,
            )
        )

    def role(self, index: int) -> bytes:
        return self._chunk([ChatChunkChoice(index, Delta(role="assistant", content=""))])

    def delta(self, index: int, chunk: GenerationChunk, logprobs: bool) -> bytes | None:
        if _nothing_new(chunk, logprobs):
            return None
        lp = _chat_logprobs(chunk.logprobs or []) if logprobs else None
        delta = Delta(content=chunk.text) if chunk.text or chunk.finish_reason is None else Delta()
        finish = str(chunk.finish_reason) if chunk.finish_reason is not None else None
        return self._chunk([ChatChunkChoice(index, delta, finish, lp)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))


@dataclass
class CompletionChunks:
    """Stream chunk builder for one text completion; tracks text offsets per choice for logprobs."""

    rid: str
    created: int
    model: str
    fingerprint: str | None = None
    offsets: dict[int, int] = field(default_factory=dict)

    def _chunk(self, choices: list[CompletionChoice], use: Usage | None = None) -> bytes:
        return sse(
            Completion(
                id=self.rid,
                object="text_completion",
                created=self.created,
                model=self.model,
                choices=choices,
                usage=use,
                system_fingerprint=self.fingerprint,
            )
        )

    def delta(self, index: int, chunk: GenerationChunk, logprobs: bool) -> bytes | None:
        if _nothing_new(chunk, logprobs):
            return None
        lp = None
        start = self.offsets.get(index, 0)
        if logprobs:
            lp = _completion_logprobs(chunk.logprobs or [], start)
        # By the tokens' own lengths, as the whole answer counts them: a chunk whose text the stream holds
        # back (a stop string's possible start) still moves the offsets of the tokens after it.
        self.offsets[index] = start + (sum(len(t.token) for t in chunk.logprobs or []) if logprobs else len(chunk.text))
        finish = str(chunk.finish_reason) if chunk.finish_reason is not None else None
        return self._chunk([CompletionChoice(index, chunk.text, finish, lp)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))
