"""A model's prompt tokenizer as a message, so a fleet gateway can tokenize without asking a worker.

A worker hands out its tokenizer once (`TokenizerSpec`, over GET /fleet/v1/tokenizer) and names
it by a fingerprint in every heartbeat; the gateway rebuilds it (`PromptTokenizer`) and turns
prompts into ids itself: one HTTP round trip less per request, on the gateway and on the worker.
Both sides run the same function over the same tokenizer, so the ids are the worker's own:

    hf    the native engine's `TextTokenizer` (tokenizers' JSON, BOS rule, chat template)
    word  the synthetic driver's word tokenizer (it has no parameters)

Only prompt tokenizing travels; detokenizing stays with the engine that generates.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from drivers.base import GenerationRequest, InvalidRequestError

if TYPE_CHECKING:
    from engine_native.model.tokenizer import Tokenizer


class HFTokenizerSpec(msgspec.Struct, frozen=True, tag="hf"):
    backend_json: str  # tokenizers.Tokenizer.to_str()
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None


class WordTokenizerSpec(msgspec.Struct, frozen=True, tag="word"):
    pass


TokenizerSpec = HFTokenizerSpec | WordTokenizerSpec
SPEC_DECODER = msgspec.json.Decoder(TokenizerSpec)


def fingerprint(spec: TokenizerSpec) -> str:
    """Names the tokenizer in heartbeats: equal fingerprints, equal ids for every prompt."""
    return hashlib.blake2b(msgspec.json.encode(spec), digest_size=16).hexdigest()


def hf_spec(tok: Tokenizer) -> HFTokenizerSpec | None:
    """The spec of a native engine's tokenizer; None for one that is not a `TextTokenizer`."""
    from engine_native.model.tokenizer import TextTokenizer

    if not isinstance(tok, TextTokenizer):
        return None
    return HFTokenizerSpec(
        backend_json=tok.backend.to_str(), bos_token_id=tok.bos_token_id, eos_token_ids=list(tok.eos_token_ids),
        add_bos_token=tok.add_bos_token, chat_template=tok.chat_template, bos_token=tok.bos_token,
        eos_token=tok.eos_token,
    )


def encode_prompt(tok: Tokenizer, request: GenerationRequest) -> list[int]:
    """The prompt's token ids: chat messages through the model's template, or the text; ids as
    given. The native driver's tokenizing, and the gateway's over an `hf` spec."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.messages is not None:
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in request.messages])
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(request.prompt or "", add_special_tokens=True)


class PromptTokenizer:
    """A spec rebuilt: `prompt_ids` is what the worker's driver would answer to tokenize."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.fingerprint = fingerprint(spec)
        self._hf: Tokenizer | None = None
        if isinstance(spec, HFTokenizerSpec):
            from tokenizers import Tokenizer as BackendTokenizer

            from engine_native.model.tokenizer import TextTokenizer

            self._hf = TextTokenizer(
                BackendTokenizer.from_str(spec.backend_json), bos_token_id=spec.bos_token_id,
                eos_token_ids=spec.eos_token_ids, add_bos_token=spec.add_bos_token, chat_template=spec.chat_template,
                bos_token=spec.bos_token, eos_token=spec.eos_token,
            )

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Raises InvalidRequestError for a prompt the worker would refuse the same way."""
        if self._hf is not None:
            return encode_prompt(self._hf, request)
        from drivers.synthetic import word_prompt_ids

        return word_prompt_ids(request)
