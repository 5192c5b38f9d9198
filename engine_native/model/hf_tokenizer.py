"""A Hugging Face folder's tokenizer: tokenizer.json with tokenizer_config.json, generation_config.json
and chat_template.jinja beside it. No torch here: the gateway tokenizes with it.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from engine_native.model.errors import ModelLoadError
from engine_native.model.hf_config import read_json_object
from engine_native.model.tokenizer import TextTokenizer


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(path: str, model_config: dict[str, Any] | None = None) -> TextTokenizer | None:
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    try:
        backend = BackendTokenizer.from_file(tok_path)
    except Exception as exc:
        raise ModelLoadError(f"cannot parse {tok_path}: {exc}") from exc
    tcfg_path = os.path.join(path, "tokenizer_config.json")
    tcfg = read_json_object(tcfg_path) if os.path.isfile(tcfg_path) else {}
    gen_path = os.path.join(path, "generation_config.json")
    gen = read_json_object(gen_path) if os.path.isfile(gen_path) else {}

    bos = _token_content(tcfg.get("bos_token"))
    eos = _token_content(tcfg.get("eos_token"))
    bos_id = backend.token_to_id(bos) if bos else None
    if bos_id is None and model_config and isinstance(model_config.get("bos_token_id"), int):
        bos_id = model_config["bos_token_id"]
    eos_ids: list[int] = []
    eos_id = backend.token_to_id(eos) if eos else None
    if eos_id is not None:
        eos_ids.append(eos_id)
    for source in (gen, model_config or {}):
        ids = source.get("eos_token_id")
        eos_ids.extend([ids] if isinstance(ids, int) else [i for i in ids or [] if isinstance(i, int)])
    if "add_bos_token" in tcfg:
        add_bos = bool(tcfg["add_bos_token"])
    else:
        # No flag: the backend's post-processor is the truth (Llama 3 adds <|begin_of_text|> there).
        with_special = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(with_special) and with_special[0] == bos_id
    template = tcfg.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return TextTokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos_token=add_bos,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
    )
