"""A Hugging Face model folder's config.json as this engine reads it: its `ModelConfig`, or why not.

No torch here: `inspect` (the gateway's deploy check) and the tokenizer loader read folders too.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine_native.config import ModelConfig
from engine_native.model.errors import ModelLoadError, UnsupportedArchitectureError

# config.json "architectures" entry -> ModelConfig.architecture
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def read_json_object(path: str) -> dict[str, Any]:
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
