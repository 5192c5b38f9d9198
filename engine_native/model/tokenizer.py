"""Text <-> token ids and chat rendering, on the `tokenizers` library (Rust, fast).

`TextTokenizer` implements the `Tokenizer` protocol (both here, without torch: the gateway
tokenizes). It is built either from a Hugging Face `tokenizer.json` (see `hf_tokenizer`) or from
GGUF metadata (see `gguf_tokenizer`); `tokenizer_loader.load_tokenizer` picks by path. BOS is added here, not by the backend's post-processor, so a
prompt whose rendered chat template already starts with BOS never gets two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: list[int]  # every id that ends generation (e.g. <|im_end|> and <|endoftext|>)
    add_bos_token: bool
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render OpenAI-style messages with the model's own template; raise ValueError on bad roles."""
        ...


# Control tokens that end an assistant turn in the chat formats we serve; any that the
# vocabulary has are added to eos_token_ids so generation stops at the end of a turn.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end|>", "<|eom_id|>")

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class TextTokenizer:
    """A `Tokenizer`: encode/decode through a `tokenizers.Tokenizer`, chat via a Jinja template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos_token: bool,
        chat_template: str | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.bos_token = bos_token if bos_token is not None else self._token_or_none(bos_token_id)
        ids = list(dict.fromkeys(eos_token_ids))  # ordered, deduplicated
        for name in END_OF_TURN_TOKENS:
            tid = backend.token_to_id(name)
            if tid is not None and tid not in ids:
                ids.append(tid)
        self.eos_token_ids: list[int] = ids
        self.eos_token = (
            eos_token if eos_token is not None else (self._token_or_none(ids[0]) if ids else None)
        )
        self._template: jinja2.Template | None = None

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while the Rust code runs (`encode` holds it throughout), so a
        # long prompt tokenized in a worker thread leaves the event loop's thread free; same ids.
        ids: list[int] = self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        bos = self.bos_token_id
        # A chat template that writes BOS itself must not get a second one.
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str:
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} outside the vocabulary of {self.vocab_size}")
        return str(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        for m in messages:
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(
                    f"unsupported chat role {m.get('role')!r}; expected one of {sorted(CHAT_ROLES)}"
                )
            if not isinstance(m.get("content", ""), str):
                raise ValueError  # noqa: TRY004 -- a bad request, mapped to 400 like the role check("chat message content must be a string")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            # raise_exception() in a template signals a malformed conversation, i.e. bad input.
            raise ValueError(f"chat template rejected the messages: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment transformers renders chat templates in, so our text matches theirs.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    helpers: dict[str, Callable[..., Any]] = {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
    }
    env.globals.update(helpers)
    return env.from_string(source)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
