"""Load a Hugging Face model folder: config.json + *.safetensors (+ tokenizer files).

Weights keep their HF names; `LlamaForCausalLM` fuses them. The tokenizer comes
from tokenizer.json and tokenizer_config.json; a folder without tokenizer.json
loads weight-only (tokenizer None), which tests use.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as BackendTokenizer
from tqdm import tqdm

from engine_native.config import ModelConfig
from engine_native.model.base import LoadedModel, ModelLoadError, UnsupportedArchitectureError
from engine_native.model.llama import LlamaForCausalLM
from engine_native.model.tokenizer import TextTokenizer

# config.json "architectures" entry -> ModelConfig.architecture
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def config_from_hf(cfg: dict[str, Any], name: str) -> ModelConfig:
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {archs} in {name} (supported: {sorted(ARCHITECTURES)})"
        )
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters; older files have both.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling: dict[str, float | str] | None = None
    if rope_type not in ("default", None):
        if rope_type not in ("llama3", "linear"):
            raise ModelLoadError(f"unsupported rope scaling {rope_type!r} in {name}")
        scaling = {k: v for k, v in rope.items() if isinstance(v, (int, float, str))}
        scaling["rope_type"] = rope_type
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        name=os.path.basename(os.path.normpath(name)),
    )


def load_hf_folder(path: str, dtype: torch.dtype, progress: bool = True) -> LoadedModel:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path} has no config.json (found: {sorted(os.listdir(path))[:10]})")
    raw = _read_json(config_path)
    cfg = config_from_hf(raw, path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path} has config.json but no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    handles = [safe_open(f, framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]  # noqa: SIM118 -- safe_open is not a dict
    for handle, key in tqdm(
        names, desc=f"loading {cfg.name}", unit="tensor", file=sys.stderr, disable=not progress
    ):
        weights[key] = handle.get_tensor(key).to(dtype)
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        raise ModelLoadError(f"{path}: no lm_head.weight and tie_word_embeddings is false")
    model = LlamaForCausalLM(cfg, weights, dtype)
    return LoadedModel(
        model=model, tokenizer=load_hf_tokenizer(path, raw), config=cfg, dtype=dtype, source=path
    )


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
    tcfg = _read_json(tcfg_path) if os.path.isfile(tcfg_path) else {}
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}

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
