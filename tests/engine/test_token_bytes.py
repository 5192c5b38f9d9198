"""A token's bytes (logprobs' `bytes`): a stream's tokens' bytes join back into its text's UTF-8, also where a
token holds part of a character, for a byte-level vocabulary (the bundled SmolLM2's) and a byte-fallback one."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from engine_native.model.bundled import bundled_model_path
from engine_native.model.token_bytes import TokenBytes, byte_stand_ins
from engine_native.model.tokenizer import TextTokenizer
from engine_native.model.tokenizer_loader import load_tokenizer

TEXTS = ["héllo wörld — “quotes”", "日本語のテキスト", "emoji 🙂👍🏽 mixed", "plain ascii", "tab\tand\nnewline"]


def test_the_byte_level_alphabet_covers_every_byte_once() -> None:
    stand_ins = byte_stand_ins()
    assert sorted(stand_ins.values()) == list(range(256)) and stand_ins["A"] == ord("A") and stand_ins["Ġ"] == 32


@pytest.mark.parametrize("text", TEXTS)
def test_a_byte_level_vocabularys_tokens_join_into_the_texts_bytes(text: str) -> None:
    tok = load_tokenizer(bundled_model_path())
    assert isinstance(tok, TextTokenizer)
    token_bytes = TokenBytes(tok)
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == text.encode("utf-8")
    if text in TEXTS[1:3]:  # these split characters across tokens: the path that decoding alone gets wrong
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_byte_fallback_pieces_are_their_byte() -> None:
    pieces = ["<unk>", "▁a", "b", *(f"<0x{b:02X}>" for b in range(256))]
    backend = BackendTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                          byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = TextTokenizer(backend, bos_token_id=None, eos_token_ids=[], add_bos_token=False, chat_template=None)
    token_bytes = TokenBytes(tok)
    ids = [pieces.index(f"<0x{b:02X}>") for b in "日".encode()]
    assert [tok.decode([i]) for i in ids] == ["\ufffd"] * 3
    assert b"".join(token_bytes(i) for i in ids) == "日".encode()
    assert token_bytes(pieces.index("b")) == b"b"
    assert token_bytes(len(pieces) + 5) == b""  # past the vocabulary
