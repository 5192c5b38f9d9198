"""Rebuild a model's tokenizer from GGUF metadata (a GGUF carries no tokenizer.json).

Supported `tokenizer.ggml.model` kinds:
  * "gpt2": byte-level BPE from tokens + merges, split the way `tokenizer.ggml.pre` says
    (llama.cpp's pre-tokenizer names);
  * "llama": SentencePiece BPE with byte fallback, merges recovered from token scores.
Control tokens (token_type 3) and user-defined ones (4) are matched whole in text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine_native.model.errors import ModelLoadError
from engine_native.model.tokenizer import TextTokenizer

_CONTROL = 3
_USER_DEFINED = 4

# Split regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp splits every digit on its own for these (StarCoder-style vocabularies), then GPT-2's regex.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def tokenizer_from_gguf(meta: dict[str, Any]) -> TextTokenizer:
    """meta: GGUF key -> python value (arrays as lists)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelLoadError("GGUF has no tokenizer.ggml.tokens")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_bpe(
            tokens, list(meta.get("tokenizer.ggml.merges") or []), meta.get("tokenizer.ggml.pre")
        )
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, list(meta.get("tokenizer.ggml.scores") or []), types)
        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos_default = True
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    _add_special(backend, tokens, types, byte_level=kind == "gpt2")

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    ]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    return TextTokenizer(
        backend,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> BackendTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))  # type: ignore[arg-type]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level]
        )
    elif pre in _DIGIT_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:  # "gpt2", "default" and unknown names: GPT-2's own regex
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int]) -> BackendTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if not scores:
        scores = [0.0] * len(tokens)
    # A merge (a, b) exists when a+b is a token; SentencePiece applies the best-scored first.
    ranked: list[tuple[float, int, int, str, str]] = []
    for merged, score in zip(tokens, scores, strict=True):
        if len(merged) < 2 or types[vocab[merged]] != 1:
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]
    unk = "<unk>" if "<unk>" in vocab else None
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)  # type: ignore[arg-type]
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def _add_special(backend: BackendTokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    spelled = set(bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types, strict=True)
        # A "control" token outside the byte alphabet is a converter mislabel, never a real token.
        if ty == _CONTROL and (spelled is None or set(t) <= spelled)
    ]
    backend.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED
    ]
    if user:
        backend.add_tokens(user)
