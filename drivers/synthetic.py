"""A model-free driver for load-testing the gateway.

It behaves like an engine from the outside: a deterministic word-level
"tokenizer", a chat template, paced streaming (time to first token, then a
fixed decode rate per request), max_tokens / stop strings / seed / logprobs,
abort, and a bounded running + waiting queue that sheds load with
`OverloadedError`. Nothing here is mocked for tests; it is a real component.

Token layout of a prompt (what `tokenize` returns and `generate` uses):

    [BOS] ( [<role>] word word ... [EOT] )* [<assistant>]      chat
    [BOS] word word ...                                          completion
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from array import array
from collections.abc import AsyncIterator

import msgspec

from drivers.base import (
    Driver,
    DriverHealth,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    NodeInfo,
    NodesReport,
    OverloadedError,
    ShuttingDownError,
    TokenLogprob,
    TopLogprob,
)
from drivers.options import EngineOptions, overrides
from drivers.portable_tokenizer import TokenizerSpec, WordTokenizerSpec

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
# Ids 0..3 are specials; words follow. Two-syllable words give a 4,900-word vocabulary.
_SPECIALS = ["<bos>", "<eot>", "<role>", "<assistant>"]
VOCAB: list[str] = _SPECIALS + [a + b for a in _SYLLABLES for b in _SYLLABLES]
BOS, EOT, ROLE, ASSISTANT = 0, 1, 2, 3
_FIRST_WORD = len(_SPECIALS)


def word_id(word: str) -> int:
    """Stable id for any whitespace-free prompt word (hash into the word range)."""
    return _FIRST_WORD + zlib.crc32(word.encode()) % (len(VOCAB) - _FIRST_WORD)


def word_prompt_ids(request: GenerationRequest) -> list[int]:
    """The word tokenizer: the layout in this module's docstring."""
    if request.prompt_token_ids is not None:
        bad = [t for t in request.prompt_token_ids if not 0 <= t < len(VOCAB)]
        if bad:
            raise InvalidRequestError(
                f"Token id {bad[0]} is out of vocabulary (size {len(VOCAB)})", "prompt"
            )
        return [BOS, *request.prompt_token_ids]
    if request.messages is not None:
        ids = [BOS]
        for message in request.messages:
            ids.append(ROLE)
            ids.extend(word_id(w) for w in message.content.split())
            ids.append(EOT)
        ids.append(ASSISTANT)
        return ids
    if request.prompt is not None:
        return [BOS, *(word_id(w) for w in request.prompt.split())]
    raise InvalidRequestError("One of prompt, prompt_token_ids or messages is required", "prompt")


class _Live:
    """Book-keeping of one admitted request, so `abort` can wake its sleeps."""

    __slots__ = ("aborted",)

    def __init__(self) -> None:
        self.aborted = asyncio.Event()


class SyntheticDriver(Driver):
    def __init__(
        self,
        model_name: str = "synthetic",
        tokens_per_second: float = 50.0,
        ttft_s: float = 0.05,
        max_model_len: int = 4096,
        max_num_seqs: int = 64,  # the native engine's bounds, so both drivers serve alike by default
        max_waiting: int = 256,
        tokenize_s: float = 0.0,  # how long tokenizing a prompt takes (a worker thread sleeps it)
        start_delay_s: float = 0.0,  # how long start() takes, like a model load (a worker's cold start)
    ) -> None:
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.model_name = model_name
        # <= 0 or inf: emit as fast as the event loop allows.
        self.token_interval_s = (
            0.0 if tokens_per_second <= 0 or math.isinf(tokens_per_second) else (1.0 / tokens_per_second)
        )
        self.ttft_s = max(0.0, ttft_s)
        self.max_model_len = max_model_len
        self.max_num_seqs = max(1, max_num_seqs)
        self.max_waiting = max(0, max_waiting)
        # Extra time tokenizing one prompt takes, in the worker thread (a slow tokenizer, for tests of
        # what happens before dispatch); the word tokenizer itself is fast.
        self.tokenize_s = max(0.0, tokenize_s)
        self.start_delay_s = max(0.0, start_delay_s)
        self.prompts_tokenized = 0  # tokenize() calls that encoded a prompt, since construction
        self._slots = asyncio.Semaphore(self.max_num_seqs)
        self._live: dict[str, _Live] = {}
        self._running = 0
        self._waiting = 0
        self._started = False
        self._starting = False
        self._created = int(time.time())
        self._tokens_generated = 0
        self._waiting_tokens = 0
        self._waiting_work: dict[int, int] = {}  # priority -> prompt + budget of the waiting requests

    @classmethod
    def from_options(cls, options: EngineOptions) -> SyntheticDriver:
        """The options that mean something to a model-free engine; unset ones keep the defaults above."""
        o = options
        return cls(**overrides(
            model_name=o.served_model_name,
            tokens_per_second=o.synthetic_tokens_per_second,
            ttft_s=o.synthetic_ttft_s,
            max_model_len=o.max_model_len,
            max_num_seqs=o.max_num_seqs,
            max_waiting=o.max_waiting,
            start_delay_s=o.synthetic_start_delay_s,
        ))

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._starting = True
        try:
            if self.start_delay_s:
                await asyncio.sleep(self.start_delay_s)  # "loading the model": not ready meanwhile
            self._started = True
        finally:
            self._starting = False

    async def stop(self) -> None:
        """Requests still running end with ShuttingDownError."""
        self._started = False
        for live in self._live.values():
            live.aborted.set()

    # -- contract --------------------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        return [ModelCard(id=self.model_name, max_model_len=self.max_model_len, created=self._created)]

    async def health(self) -> DriverHealth:
        return DriverHealth(
            ready=self._started,
            detail="synthetic" if self._started else "starting" if self._starting else "not started",
            starting=self._starting,
            running=self._running,
            waiting=self._waiting,
            generation_tokens_per_s=self._generation_rate(),
            waiting_tokens=self._waiting_tokens,
            waiting_work_by_priority={p: w for p, w in self._waiting_work.items() if w},
            max_waiting=self.max_waiting,
            max_num_seqs=self.max_num_seqs,
        )

    def _generation_rate(self) -> float:
        """Tokens/s being generated now: every running request decodes at the configured pace."""
        if self.token_interval_s <= 0:
            return 0.0  # unthrottled: no meaningful rate
        return self._running / self.token_interval_s

    def nodes(self) -> NodesReport:
        # One pseudo-node: it never slows down, but the admin API and console have something to show.
        node = NodeInfo(id="synthetic", status="healthy" if self._started else "dead",
                        running=self._running, waiting=self._waiting)
        return NodesReport([node], [])

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        if request.model != self.model_name:
            raise ModelNotFoundError(request.model)
        self.prompts_tokenized += 1
        # A worker thread, like a real tokenizer: a long prompt must not stall the other streams.
        return await asyncio.to_thread(self._prompt_ids, request)

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.aborted.set()

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._generate(request)

    # -- internals -------------------------------------------------------------------------------

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if self.tokenize_s:
            time.sleep(self.tokenize_s)  # in the worker thread, never on the event loop
        return word_prompt_ids(request)

    def tokenizer_spec(self, model: str) -> TokenizerSpec | None:
        # With a deliberately slow tokenizer (tests of what happens before dispatch), none travels.
        return WordTokenizerSpec() if model == self.model_name and not self.tokenize_s else None

    def _budget(self, request: GenerationRequest, prompt_len: int) -> int:
        if request.max_tokens is not None and request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        room = self.max_model_len - prompt_len
        if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
            wanted = request.max_tokens if request.max_tokens is not None else 1
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} in the completion).",
                "max_tokens",
            )
        return request.max_tokens if request.max_tokens is not None else room

    def _admit(self, request_id: str) -> None:
        if not self._started:
            raise OverloadedError("The engine is not started", retry_after=1.0)
        if self._slots.locked() and self._waiting >= self.max_waiting:
            # A slot frees up roughly every (ttft + a typical decode) / running seconds.
            raise OverloadedError(
                f"Too many requests in flight ({self._running} running, {self._waiting} waiting)",
                retry_after=1.0,
            )
        if request_id in self._live:
            raise InvalidRequestError(f"Duplicate request id {request_id}", "request_id")

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.model != self.model_name:
            raise ModelNotFoundError(request.model)
        prompt_ids = request.tokenized_prompt
        if prompt_ids is None:
            prompt_ids = await self.tokenize(request)
        elif any(not 0 <= t < len(VOCAB) for t in prompt_ids):  # ids from afar (a fleet worker's wire)
            raise InvalidRequestError(f"Token ids must be in [0, {len(VOCAB)}): out of vocabulary", "prompt")
        budget = self._budget(request, len(prompt_ids))
        self._admit(request.request_id)  # synchronous: check-and-enqueue cannot interleave
        arrival = time.time()
        live = self._live[request.request_id] = _Live()
        work = len(prompt_ids) + budget
        self._waiting += 1
        self._waiting_tokens += len(prompt_ids)
        self._waiting_work[request.priority] = self._waiting_work.get(request.priority, 0) + work
        acquired = False
        try:
            try:
                await self._slots.acquire()
                acquired = True
            finally:
                self._waiting -= 1
                self._waiting_tokens -= len(prompt_ids)
                self._waiting_work[request.priority] -= work
            self._running += 1
            try:
                async for chunk in self._decode(request, prompt_ids, budget, live, arrival):
                    yield chunk
            finally:
                self._running -= 1
        finally:
            if acquired:
                self._slots.release()
            self._live.pop(request.request_id, None)

    async def _decode(
        self, request: GenerationRequest, prompt_ids: list[int], budget: int, live: _Live, arrival: float
    ) -> AsyncIterator[GenerationChunk]:
        # temperature 0 is greedy: each token is a function of the whole context so far (a running
        # CRC over prompt and output), like a real model, so a request resumed elsewhere from prompt +
        # the tokens already sent goes on exactly as it would have (drivers/fleet failover).
        greedy = request.seed is None and request.temperature == 0
        context = _context_hash(prompt_ids)
        if request.seed is not None:
            seed: int = request.seed
        elif greedy:
            seed = context
        else:
            seed = random.getrandbits(32)
        rng = random.Random(seed)
        lp_rng = random.Random(seed ^ 0x5EED)  # separate stream: logprobs never change the text
        stops = [s for s in request.stop if s]
        holdback = max((len(s) for s in stops), default=1) - 1
        loop = asyncio.get_running_loop()
        scheduled = time.time()
        start = loop.time()
        text = ""
        emitted = 0  # chars of `text` already sent
        first_token_time: float | None = None
        for i in range(budget):
            due = start + self.ttft_s + i * self.token_interval_s
            if await self._sleep_until(due, live):
                if not self._started:  # stopped under it: the server is shutting down, not the client gone
                    raise ShuttingDownError("The server is shutting down; retry the request", retry_after=1.0)
                yield self._chunk(request, "", [], len(prompt_ids), i, FinishReason.ABORT, None)
                return
            if greedy:
                tid = _FIRST_WORD + context % (len(VOCAB) - _FIRST_WORD)
                context = _context_hash([tid], context)
            else:
                tid = rng.randrange(_FIRST_WORD, len(VOCAB))
            first_token_time = first_token_time or time.time()
            search_from = max(0, len(text) - holdback)
            text += (" " if i or request.resumed_output_tokens else "") + VOCAB[tid]
            self._tokens_generated += 1
            finish: FinishReason | None = None
            cut = min((p for p in (text.find(s, search_from) for s in stops) if p >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], FinishReason.STOP
            elif i + 1 == budget:
                finish = FinishReason.LENGTH
            upto = len(text) if finish else max(emitted, len(text) - holdback)
            delta, emitted = text[emitted:upto], upto
            logprobs = self._logprobs(tid, request.logprobs, lp_rng) if request.logprobs is not None else None
            chunk = self._chunk(request, delta, [tid], len(prompt_ids), i + 1, finish, logprobs)
            if finish:
                chunk = _with_times(chunk, arrival, scheduled, first_token_time)
                yield chunk
                return
            yield chunk

    async def _sleep_until(self, due: float, live: _Live) -> bool:
        """Sleep until loop time `due`; True when the request was aborted meanwhile."""
        delay = due - asyncio.get_running_loop().time()
        if live.aborted.is_set():
            return True
        if delay <= 0:
            await asyncio.sleep(0)  # stay fair to other streams even when unthrottled
            return live.aborted.is_set()
        try:
            await asyncio.wait_for(live.aborted.wait(), timeout=delay)
            return True
        except TimeoutError:
            return False

    @staticmethod
    def _logprobs(tid: int, top_n: int, rng: random.Random) -> list[TokenLogprob]:
        sampled = -rng.uniform(0.01, 2.0)
        top = [TopLogprob(token=VOCAB[tid], logprob=sampled, bytes=list(VOCAB[tid].encode()))]
        value = sampled
        while len(top) < top_n:
            value -= rng.uniform(0.1, 1.5)  # strictly decreasing alternatives
            alt = VOCAB[rng.randrange(_FIRST_WORD, len(VOCAB))]
            top.append(TopLogprob(token=alt, logprob=value, bytes=list(alt.encode())))
        return [
            TokenLogprob(
                token=VOCAB[tid], logprob=sampled, bytes=list(VOCAB[tid].encode()), top_logprobs=top[:top_n]
            )
        ]

    @staticmethod
    def _chunk(
        request: GenerationRequest,
        text: str,
        token_ids: list[int],
        prompt_tokens: int,
        completion_tokens: int,
        finish: FinishReason | None,
        logprobs: list[TokenLogprob] | None,
    ) -> GenerationChunk:
        return GenerationChunk(
            request_id=request.request_id,
            text=text,
            token_ids=token_ids,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish,
            logprobs=logprobs,
            node_id="synthetic",
            token_time=time.time() if token_ids else None,
        )


def _context_hash(ids: list[int], running: int = 0) -> int:
    """CRC-32 of token ids, continued from `running`: hash(a + b) == _context_hash(b, hash(a))."""
    return zlib.crc32(array("I", ids).tobytes(), running)


def _with_times(
    chunk: GenerationChunk, arrival: float, scheduled: float, first: float | None
) -> GenerationChunk:
    return msgspec.structs.replace(
        chunk,
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=first,
        finish_time=time.time(),
    )
