"""Per-request incremental detokenization and stop-string matching.

Two buffers, drawn over the request's tokens and text:

    tokens:  | prompt tail ... |<- prefix window ->|<- unread ->|
                               ^ prefix_offset     ^ read_offset
    text:    | emitted (self.text) |<- held back ->|

Each `append` decodes only the window tokens[prefix_offset:] and emits what it
adds beyond tokens[prefix_offset:read_offset] (the prefix gives the tokenizer
the context it needs for spaces and merges), so the cost per token is O(1),
not O(length). Decoded text that ends in U+FFFD is an incomplete UTF-8
sequence split across byte-level tokens; it stays unread until the next token
completes it.

Newly read text then passes the stop-string matcher, which holds back the
longest tail that could still grow into a stop string, so a partial stop
string is never emitted and later retracted.

A match is the stop string that *completes* first in the text (ties: the one
that starts first). That is what a character-by-character reader would see,
so the result does not depend on where token boundaries fall.
"""

from __future__ import annotations

from engine_native.model.tokenizer import Tokenizer
from engine_native.sampling_params import SamplingParams

# How many prompt tokens seed the prefix window: enough for the tokenizer to
# render the first output token's leading space or merge the way it would in context.
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        # Only the prompt tail is kept: the window never reaches further back.
        self._tokens: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._held = ""  # read text not yet emitted: it could be the start of a stop string
        self._emitted: list[str] = []
        self._stopped: str | None = None
        self._finished = False

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, if any."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]  # join once, not on every read
        return self._emitted[0] if self._emitted else ""

    def append(self, token_id: int) -> str:
        """Feed one generated token; return the text that is now safe to send."""
        if self._stopped is not None or self._finished:
            return ""
        self._tokens.append(token_id)
        new_text = self._read(final=False)
        return self._emit(self._match(new_text, final=False))

    def flush(self) -> str:
        """On finish: everything still unread or held back (a trailing incomplete
        character comes out as U+FFFD, as in a full decode)."""
        if self._stopped is not None or self._finished:
            return ""
        self._finished = True
        new_text = self._read(final=True)
        return self._emit(self._match(new_text, final=True))

    def _read(self, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._tokens[self._prefix_offset :])
        # Shorter or equal: the new tokens added nothing yet (e.g. skipped special tokens);
        # keep them unread so the window widens until they do.
        if len(window_text) <= len(prefix_text):
            return ""
        if window_text.endswith(_INCOMPLETE) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return window_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _match(self, new_text: str, final: bool) -> str:
        """Run the stop matcher over held + new text; return what may be emitted now."""
        buffer = self._held + new_text
        self._held = ""
        if not self._stops:
            return buffer
        # Any stop string that completes inside new_text starts inside `buffer`: what lies
        # before new_text is a prefix of it, and `_held` is the longest such tail.
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, _, stop = best
            self._stopped = stop
            return buffer[:end] if self._include_stop else buffer[: end - len(stop)]
        if final:
            return buffer
        hold = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), self._max_stop_len - 1), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
