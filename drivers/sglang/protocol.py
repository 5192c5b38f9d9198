"""SGLang's native HTTP wire, as the driver speaks it, and the stream outputs turned into deltas.

    POST /generate        {"rid", "input_ids", "sampling_params", "stream": true, "return_logprob",
                           "top_logprobs_num", "return_text_in_logprobs", "priority"}
                          -> 200 text/event-stream: "data: <GenerateOut JSON>" events, "data: [DONE]"
                             (an error after the 200: "data: {"error": {"message": ...}}")
                          -> 400 {"error": {"message"}} or {"object": "error", "message", "code"}
    POST /abort_request   {"rid"}
    POST /tokenize        {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}
    GET  /health_generate 200 when a one-token generation went through; 503 while starting / unhealthy
    GET  /v1/models, /get_model_info, /get_server_info, /get_load
    GET  /metrics         Prometheus text, with --enable-metrics: sglang:num_running_reqs,
                          sglang:num_queue_reqs, sglang:token_usage (one sample per DP rank / label set)

One stream output (`GenerateOut`) has the text, the token ids and `meta_info` (counts,
`cached_tokens`, `finish_reason` as {"type": "stop" | "length" | "abort", "matched", "message",
"status_code"}, logprobs as [logprob, token id, text] triples). A server started plainly sends them
cumulative: each event repeats the whole output so far. Started with
`--incremental-streaming-output`, each event carries only what is new. `StreamDelta` turns either
into what is new, and holds back text that may be the start of a stop string, so a stop string is
never sent in part (SGLang trims it only from the text of the final event).
"""

from __future__ import annotations

from typing import Any

import msgspec

from drivers.base import FinishReason, GenerationRequest, TokenLogprob, TopLogprob

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"
TOKENIZE_PATH = "/tokenize"
HEALTH_PATH = "/health_generate"
MODELS_PATH = "/v1/models"
MODEL_INFO_PATH = "/get_model_info"
SERVER_INFO_PATH = "/get_server_info"
LOAD_PATH = "/get_load"
METRICS_PATH = "/metrics"
DONE = b"[DONE]"

# [logprob, token id, token text]; SGLang's JSON writes -inf as null, hence the optional logprob.
LogprobEntry = tuple[float | None, int, str | None]


class FinishInfo(msgspec.Struct, frozen=True):
    type: str
    matched: int | str | None = None
    message: str | None = None
    status_code: int | None = None


class MetaInfo(msgspec.Struct, frozen=True):
    id: str = ""
    finish_reason: FinishInfo | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str = ""


class GenerateOut(msgspec.Struct, frozen=True):
    """One event of a /generate stream (fields SGLang adds that we do not use are ignored)."""

    text: str | None = None
    output_ids: list[int] | None = None
    meta_info: MetaInfo = MetaInfo()
    error: ErrorDetail | None = None


class ErrorBody(msgspec.Struct, frozen=True):
    """A refusal before the stream: {"error": {"message"}} (native endpoints), OpenAI's
    {"object": "error", "message", "code"} (request validation), or FastAPI's {"detail"}."""

    error: ErrorDetail | None = None
    message: str | None = None
    detail: Any = None

    def text(self) -> str:
        if self.error is not None:
            return self.error.message
        return self.message or (str(self.detail) if self.detail is not None else "")


OUT_DECODER = msgspec.json.Decoder(GenerateOut)
ERROR_DECODER = msgspec.json.Decoder(ErrorBody)


def generate_body(request: GenerationRequest, rid: str, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Our request as SGLang's GenerateReqInput. Sampling maps one to one except: top_k 0 ("all")
    is SGLang's -1, and priority is negated (ours: lower is more important; SGLang's default
    schedules higher values first; it ignores priority unless --enable-priority-scheduling)."""
    r = request
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
        "top_k": r.top_k if r.top_k > 0 else -1, "min_p": r.min_p, "repetition_penalty": r.repetition_penalty,
        "presence_penalty": r.presence_penalty, "frequency_penalty": r.frequency_penalty,
        "stop": list(r.stop), "stop_token_ids": list(r.stop_token_ids), "ignore_eos": r.ignore_eos,
    }
    if r.seed is not None:
        sampling["sampling_seed"] = r.seed
    if r.logit_bias:  # SGLang's SamplingParams.logit_bias: token ids as strings
        sampling["logit_bias"] = {str(t): v for t, v in r.logit_bias.items()}
    body: dict[str, Any] = {
        "rid": rid, "input_ids": input_ids, "sampling_params": sampling, "stream": True, "priority": -r.priority,
    }
    if r.logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=r.logprobs, return_text_in_logprobs=True)
    return body


def finish_reason(info: FinishInfo) -> FinishReason:
    if info.type == "length":
        return FinishReason.LENGTH
    if info.type == "abort":
        return FinishReason.ABORT
    return FinishReason.STOP


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    """What one stream output added; `completion_tokens` and `cached_tokens` are as SGLang counts them."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish: FinishInfo | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class StreamDelta:
    """The text and tokens of one request as the stream outputs arrive.

        full_text  what SGLang has produced so far (rebuilt from increments in incremental mode)
        |<------ sent ------>|<- held ->|     held: a tail that is the start of a stop string
    """

    def __init__(self, incremental: bool, stops: list[str], logprobs: int | None) -> None:
        self.incremental = incremental
        self.stops = [s for s in stops if s]
        self.want_logprobs = logprobs is not None
        self.full_text = ""
        self.sent = 0  # characters of full_text already handed out
        self.ids_seen = 0
        self.logprobs_seen = 0

    def feed(self, out: GenerateOut) -> Delta:
        meta = out.meta_info
        ids = out.output_ids or []
        new_ids = ids if self.incremental else ids[self.ids_seen:]
        self.ids_seen += len(new_ids)
        text = out.text or ""
        if self.incremental:
            self.full_text += text
        elif len(text) >= len(self.full_text) or meta.finish_reason is not None:
            self.full_text = text
        finish = meta.finish_reason
        if finish is None:
            end = len(self.full_text) - self._held()
        else:
            if finish.type == "stop" and isinstance(finish.matched, str) and finish.matched:
                self.full_text = _cut_stop(self.full_text, finish.matched, self.sent)
            end = len(self.full_text)
        piece = self.full_text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return Delta(text=piece, token_ids=list(new_ids), logprobs=self._logprobs(meta) if self.want_logprobs else None,
                     finish=finish, prompt_tokens=meta.prompt_tokens, completion_tokens=meta.completion_tokens,
                     cached_tokens=meta.cached_tokens)

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.full_text)), longest, -1):
                if self.full_text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _logprobs(self, meta: MetaInfo) -> list[TokenLogprob]:
        tokens = meta.output_token_logprobs or []
        tops = meta.output_top_logprobs or []
        start = 0 if self.incremental else self.logprobs_seen
        new = tokens[start:]
        new_tops = tops[start:] if len(tops) >= len(tokens) else []
        self.logprobs_seen += len(new)
        out = []
        for i, (logprob, _, text) in enumerate(new):
            top = new_tops[i] if i < len(new_tops) else None
            out.append(TokenLogprob(
                token=text or "", logprob=_finite(logprob), bytes=list((text or "").encode()),
                top_logprobs=[TopLogprob(token=t or "", logprob=_finite(lp), bytes=list((t or "").encode()))
                              for lp, _, t in (top or [])],
            ))
        return out


def _cut_stop(text: str, stop: str, sent: int) -> str:
    """The text without the matched stop string. A server may or may not have trimmed it already, and
    in incremental mode the final delta may carry only part of it: cut the whole stop string if it is
    there (after what was sent), else the held tail that is its beginning."""
    at = text.find(stop, max(0, sent - len(stop) + 1))
    if at >= 0:
        return text[:at]
    for k in range(min(len(stop) - 1, len(text) - sent), 0, -1):
        if text.endswith(stop[:k]):
            return text[:-k]
    return text


def _finite(logprob: float | None) -> float:
    return logprob if logprob is not None else -9999.0  # OpenAI's convention for -inf
