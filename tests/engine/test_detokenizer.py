"""Incremental detokenization and stop strings, against a real byte-level BPE tokenizer.

The tokenizer is trained here on a tiny corpus, so emoji and most CJK characters
are split across several byte-level tokens: exactly the case where a naive
streamer emits U+FFFD.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import ByteLevelBPETokenizer

from engine_native.detokenizer import IncrementalDetokenizer
from engine_native.sampling_params import SamplingParams
from engine_native.stop import check_stop_token

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there, say hello again",
    "naïve café résumé façade",
    "你好世界 你好 世界",
    "stop here STOP there, stopping is hard",
] * 20
EOS = "<|endoftext|>"


class ByteLevelTokenizer:
    """Adapts a `tokenizers` byte-level BPE model to the engine's Tokenizer protocol."""

    def __init__(self) -> None:
        self._tokenizer = ByteLevelBPETokenizer()
        self._tokenizer.train_from_iterator(
            CORPUS, vocab_size=400, min_frequency=2, special_tokens=[EOS], show_progress=False
        )
        eos_id = self._tokenizer.token_to_id(EOS)
        assert eos_id is not None
        self.bos_token_id: int | None = None
        self.eos_token_ids: list[int] = [eos_id]
        self.add_bos_token = False
        self.vocab_size: int = self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str:
        token: str | None = self._tokenizer.id_to_token(token_id)
        if token is None:
            raise KeyError(token_id)
        return token

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


TOKENIZER = ByteLevelTokenizer()


def _stream(
    text: str,
    params: SamplingParams,
    prompt: str = "Q: ",
    extra_ids: tuple[int, ...] = (),
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `text`'s tokens one at a time; return every piece (the flush last)."""
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt), params)
    pieces: list[str] = []
    for token_id in [*TOKENIZER.encode(text), *extra_ids]:
        pieces.append(detok.append(token_id))
        if detok.stopped is not None:
            break
    pieces.append(detok.flush())
    return pieces, detok


def _reference(text: str, stops: list[str], include: bool) -> str:
    """Cut at the first point where any stop string has fully appeared (ties: the longest)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if stop and text[:end].endswith(stop):
                return text[:end] if include else text[: end - len(stop)]
    return text


MULTIBYTE = "party 🎉🚀 time, 你好世界 and 漢字テスト, naïve 👩‍👩‍👧 end"


def test_multibyte_characters_really_are_split_across_tokens() -> None:
    ids = TOKENIZER.encode("🎉")
    assert len(ids) > 1
    assert "\ufffd" in TOKENIZER.decode(ids[:1])


@pytest.mark.parametrize("prompt", ["", "Q: ", "你"])
def test_streamed_text_equals_full_decode_and_never_holds_a_broken_char(prompt: str) -> None:
    pieces, detok = _stream(MULTIBYTE, SamplingParams(), prompt=prompt)
    ids = TOKENIZER.encode(MULTIBYTE)
    assert "".join(pieces) == TOKENIZER.decode(ids) == MULTIBYTE == detok.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[-1] == ""  # nothing left over: every character completed before the end


def test_flush_emits_a_trailing_incomplete_character_like_a_full_decode() -> None:
    ids = TOKENIZER.encode("ok 🎉")[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(TOKENIZER, [], SamplingParams())
    streamed = "".join(detok.append(t) for t in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == TOKENIZER.decode(ids)


def test_skip_special_tokens() -> None:
    eos = tuple(TOKENIZER.eos_token_ids)
    skipped, _ = _stream("hello", SamplingParams(), extra_ids=eos)
    kept, _ = _stream("hello", SamplingParams(skip_special_tokens=False), extra_ids=eos)
    assert "".join(skipped) == "hello"
    assert "".join(kept) == "hello" + EOS


def test_stop_string_split_across_tokens_is_cut() -> None:
    text = "hello world, say hello again"
    stop = "o w"
    assert not any(stop in TOKENIZER.decode([t]) for t in TOKENIZER.encode(text))  # really spans tokens
    pieces, detok = _stream(text, SamplingParams(stop=[stop]))
    assert detok.stopped == stop
    assert "".join(pieces) == detok.text == "hell"


def test_include_stop_str_in_output() -> None:
    pieces, detok = _stream(
        "hello world, again", SamplingParams(stop=["o w"], include_stop_str_in_output=True)
    )
    assert "".join(pieces) == "hello w"
    assert detok.stopped == "o w"


def test_stop_string_with_multibyte_characters() -> None:
    pieces, detok = _stream(MULTIBYTE, SamplingParams(stop=["🚀 ti", "世界"]))
    assert detok.stopped == "🚀 ti"
    assert "".join(pieces) == "party 🎉"


def test_hold_back_releases_a_false_start_and_never_leaks_a_real_one() -> None:
    # "wor" in "world" looks like the start of "work" and must be held, then released;
    # "wo" in "work" must never be emitted.
    text = "hello world, time to work now"
    detok = IncrementalDetokenizer(TOKENIZER, [], SamplingParams(stop=["work"]))
    emitted = ""
    for token_id in TOKENIZER.encode(text):
        emitted += detok.append(token_id)
        assert not emitted.endswith(("w", "wo", "wor"))  # a live partial stop string is held
        if detok.stopped:
            break
    assert detok.stopped == "work"
    assert emitted + detok.flush() == "hello world, time to "


def test_appends_after_a_stop_emit_nothing() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], SamplingParams(stop=["lo"]))
    out = "".join(detok.append(t) for t in TOKENIZER.encode("hello hello hello"))
    assert out == "hel" and detok.flush() == "" and detok.text == "hel"


def test_earliest_completing_stop_wins() -> None:
    # "bc" completes before "abcd" does, whatever the token boundaries.
    _, detok = _stream("xx abcd yy", SamplingParams(stop=["abcd", "bc"]))
    assert detok.text == "xx a" and detok.stopped == "bc"


ALPHABET = st.sampled_from(list("abc xyz,.!\n") + ["é", "你", "好", "🎉", "🚀", "ö", "字"])
TEXTS = st.text(alphabet=ALPHABET, min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    text=TEXTS,
    random_stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    slices=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), max_size=2),
    include=st.booleans(),
)
def test_streaming_matches_reference(
    text: str, random_stops: list[str], slices: list[tuple[int, int]], include: bool
) -> None:
    # Half the stops are cut from the text itself, so matches (and near-matches) are common.
    stops = random_stops + [text[i : i + n] for i, n in slices if text[i : i + n]]
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    expected = _reference(text, stops, include)
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("Q: "), params)
    pieces: list[str] = []
    for token_id in TOKENIZER.encode(text):
        pieces.append(detok.append(token_id))
        assert "\ufffd" not in pieces[-1]
        # Emission is append-only, so being a prefix at every step means nothing is ever retracted.
        assert expected.startswith("".join(pieces))
        if detok.stopped is not None:
            break
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == expected
    assert (detok.stopped is not None) == any(s in text for s in stops)


def test_check_stop_token() -> None:
    eos = [7, 8]
    params = SamplingParams(max_tokens=3, stop_token_ids=[42])
    assert check_stop_token(5, params, eos, 1) is None
    assert check_stop_token(8, params, eos, 1) == "stop"
    assert check_stop_token(42, params, eos, 1) == "stop"
    assert check_stop_token(5, params, eos, 3) == "length"
    assert check_stop_token(7, params, eos, 3) == "stop"
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[42])
    assert check_stop_token(8, ignoring, eos, 1) is None
    assert check_stop_token(42, ignoring, eos, 1) == "stop"
