"""The prompts of `sluice bench serve`: the construction of `vllm bench serve --dataset-name random`, or
random words.

`random`, as vLLM's random dataset builds it (`--random-input-len n`, `--random-output-len m`,
`--random-range-ratio r`, `--random-prefix-len p`, `--seed`), from one numpy generator seeded once:

    s          = special tokens the tokenizer adds to a prompt (BOS), taken off n
    input_len  ~ uniform integers [floor((n - s)(1 - r)), ceil((n - s)(1 + r))]     per request
    output_len ~ uniform integers [max(1, floor(m(1 - r))), max(1, ceil(m(1 + r)))]  per request (max_tokens)
    offset     ~ uniform integers [0, vocab)                                         per request
    prefix     = p ids drawn from `allowed` once, shared by every request
    prompt i   = prefix + allowed[(offset + i + k) % len(allowed)] for k < input_len

`allowed` is the vocabulary without its special tokens. The ids are decoded to text; since text does
not always re-encode to the same number of tokens, the text is re-encoded and the ids cut to the
target or padded with random ids, up to 10 times, and the last decoded text is the prompt. Its
client-side length (`Prompt.prompt_len`) is what the server is expected to count; the report uses the
server's own count (`usage.prompt_tokens`) where the server gives one, as vLLM's client does.

`words`: the same lengths, but each token is a word of `benchmarks.words` (about one token each in
common vocabularies); no tokenizer needed, for servers whose tokenizer we cannot load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from benchmarks.words import WORDS

DatasetName = Literal["random", "words"]
_MAX_RETOKENIZE = 10


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_len: int  # tokens, as the client counts them
    output_len: int  # max_tokens of the request


@dataclass(frozen=True)
class PromptSpec:
    """Defaults in `serve.BenchConfig`; these are the figures one run's prompts are drawn from."""

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    seed: int


class PromptTokenizer(Protocol):
    """What the construction needs of the served model's tokenizer."""

    vocab_size: int  # ids [0, vocab_size) are drawn from
    special_ids: frozenset[int]
    num_special_tokens_to_add: int

    def encode(self, text: str) -> list[int]: ...  # without special tokens

    def decode(self, ids: list[int]) -> str: ...  # special tokens kept as text


class ServedModelTokenizer:
    """A `PromptTokenizer` over the tokenizer of a model path (GGUF file or Hugging Face folder)."""

    def __init__(self, path: str) -> None:
        from engine_native.model.tokenizer_loader import load_tokenizer  # lazy: reads the model's header

        tokenizer = load_tokenizer(path)
        backend = getattr(tokenizer, "backend", None)
        if tokenizer is None or backend is None:
            raise SystemExit(f"no tokenizer in {path}; pass --tokenizer, or --dataset-name words")
        self.path = path
        self._tokenizer = tokenizer
        # Like Hugging Face's `vocab_size`: the base vocabulary, without tokens added on top of it.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=False)
        specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        specials |= set(tokenizer.eos_token_ids)
        if tokenizer.bos_token_id is not None:
            specials.add(tokenizer.bos_token_id)
        self.special_ids = frozenset(specials)
        self.num_special_tokens_to_add = len(tokenizer.encode("", add_special_tokens=True)) - len(
            tokenizer.encode("", add_special_tokens=False)
        )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def _lengths(
    rng: np.random.Generator, spec: PromptSpec, num_special: int, vocab_size: int
) -> tuple[list[int], list[int], list[int]]:
    """Input lengths (without the special tokens), output lengths and vocabulary offsets, per request."""
    if not 0.0 <= spec.range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), not {spec.range_ratio}")
    n = max(0, spec.input_len - num_special)
    in_lo, in_hi = math.floor(n * (1 - spec.range_ratio)), math.ceil(n * (1 + spec.range_ratio))
    out_lo = max(1, math.floor(spec.output_len * (1 - spec.range_ratio)))
    out_hi = max(1, math.ceil(spec.output_len * (1 + spec.range_ratio)))
    if spec.prefix_len + in_lo < 1:
        raise ValueError("prompts could be empty: raise --input-len or --random-prefix-len")
    size = spec.num_prompts
    inputs = rng.integers(in_lo, in_hi + 1, size=size).tolist()
    outputs = rng.integers(out_lo, out_hi + 1, size=size).tolist()
    offsets = rng.integers(0, vocab_size, size=size).tolist()
    return inputs, outputs, offsets


def _fit_to_length(
    tokenizer: PromptTokenizer, ids: list[int], target: int, rng: np.random.Generator
) -> tuple[str, int]:
    """Text whose re-encoding has `target` tokens where a few tries get there -> (text, its length)."""
    for tries_left in range(_MAX_RETOKENIZE, -1, -1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text)
        if len(ids) == target or tries_left == 0:
            break
        if len(ids) < target:
            ids += rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist()
        else:
            ids = ids[:target]
    return text, len(ids)


def random_token_prompts(spec: PromptSpec, tokenizer: PromptTokenizer) -> list[Prompt]:
    rng = np.random.default_rng(spec.seed)
    inputs, outputs, offsets = _lengths(rng, spec, tokenizer.num_special_tokens_to_add, tokenizer.vocab_size)
    allowed = np.array([i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids])
    prefix = allowed[rng.integers(0, len(allowed), size=spec.prefix_len)].tolist() if spec.prefix_len else []
    prompts = []
    for i, (n, m, offset) in enumerate(zip(inputs, outputs, offsets, strict=True)):
        body = allowed[(offset + i + np.arange(n)) % len(allowed)].tolist()
        text, length = _fit_to_length(tokenizer, prefix + body, spec.prefix_len + n, rng)
        prompts.append(Prompt(text, length, m))
    return prompts


def random_word_prompts(spec: PromptSpec) -> list[Prompt]:
    rng = np.random.default_rng(spec.seed)
    inputs, outputs, _ = _lengths(rng, spec, 0, len(WORDS))
    prefix = [WORDS[k] for k in rng.integers(0, len(WORDS), size=spec.prefix_len)]
    prompts = []
    for n, m in zip(inputs, outputs, strict=True):
        words = prefix + [WORDS[k] for k in rng.integers(0, len(WORDS), size=n)]
        prompts.append(Prompt(" ".join(words), len(words), m))
    return prompts


def make_prompts(dataset: DatasetName, spec: PromptSpec, tokenizer: PromptTokenizer | None) -> list[Prompt]:
    if dataset == "words":
        return random_word_prompts(spec)
    if tokenizer is None:
        raise ValueError("the random dataset needs the served model's tokenizer")
    return random_token_prompts(spec, tokenizer)
