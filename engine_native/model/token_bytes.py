"""The bytes a token adds to a text: what OpenAI's logprobs report as `bytes`.

A token's text decoded alone is not always its bytes: a byte-level BPE vocabulary (GPT-2's, SmolLM2's,
Llama 3's) splits a multi-byte UTF-8 character across tokens, and each part decodes alone to U+FFFD,
whose own three bytes then stood in for the token's. `bytes` exists so that a client can join a stream's
tokens back into its text; so it must be the token's own bytes:

    byte-level vocabulary   each character of the token's vocabulary string stands for one byte
                            (GPT-2's printable stand-ins for the 256 byte values)
    byte-fallback pieces    a SentencePiece vocabulary's `<0xE2>` is that one byte
    anything else           the UTF-8 of the token decoded alone
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine_native.model.gguf_tokenizer import bytes_to_unicode
from engine_native.model.tokenizer import TextTokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_stand_ins() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each printable stand-in character -> the byte it spells."""
    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_types(decoder: Any) -> list[str]:
    if not isinstance(decoder, dict):
        return []
    return [str(decoder.get("type")), *(t for d in decoder.get("decoders") or [] for t in _decoder_types(d))]


class TokenBytes:
    """`token_bytes(token_id)` for one tokenizer; the vocabulary's kind is read once, at construction."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        # The decoder's own JSON (its pickled state), not the whole tokenizer's: that is MBs.
        decoder = tokenizer.backend.decoder
        types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else []
        self._stand_ins = byte_stand_ins() if "ByteLevel" in types else None

    def __call__(self, token_id: int) -> bytes:
        tok = self._tokenizer
        try:
            piece = tok.id_to_token(token_id)
        except KeyError:  # past the tokenizer's vocabulary (a model's padded embedding rows)
            return b""
        stand_ins = self._stand_ins
        # Special tokens (<|im_end|>) are printable ASCII, which stands for itself: their own bytes either way.
        if stand_ins is not None and all(c in stand_ins for c in piece):
            return bytes(stand_ins[c] for c in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
