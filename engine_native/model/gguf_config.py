"""A GGUF file's header as this engine reads it: the architectures it loads, the `ModelConfig` its
metadata gives, and `open_gguf`, where every loader of a GGUF starts. No tensor is read and no torch is
imported here: the gateway reads the tokenizer and `inspect` the size from the same header.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from engine_native.config import ModelConfig
from engine_native.model.errors import ModelLoadError, UnsupportedArchitectureError
from engine_native.model.gguf_file import GGUFTensor, read_gguf

# GGUF arch -> our ModelConfig.architecture, and whether the converter permuted q/k.
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
}


def config_from_metadata(meta: dict[str, Any], name: str) -> ModelConfig:
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {gguf_arch!r} in {name} (supported: {sorted(ARCHITECTURES)})"
        )
    a = gguf_arch

    def key(k: str, default: Any = None) -> Any:
        v = meta.get(f"{a}.{k}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata {a}.{k} missing in {name}")
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(
        meta.get(f"{a}.attention.key_length", meta.get(f"{a}.rope.dimension_count", hidden // heads))
    )
    vocab = meta.get(f"{a}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    rope_scaling: dict[str, float | str] | None = None
    scaling_type = meta.get(f"{a}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"unsupported GGUF rope scaling type {scaling_type!r} in {name}")
    return ModelConfig(
        architecture=ARCHITECTURES[a][0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        attention_bias=ARCHITECTURES[a][0] == "qwen2",
        tie_word_embeddings=False,  # decided below from the presence of output.weight
        name=str(meta.get("general.name") or os.path.basename(name)),
    )


class GGUFFile(NamedTuple):
    """An opened GGUF file, before any tensor is read: what every loader of one starts from."""

    tensors: list[GGUFTensor]  # views of the mapped file, not yet read
    meta: dict[str, Any]  # the header's key/values
    # From the header alone: the loaders settle tied embeddings, vocab size and rope scaling from the tensors.
    config: ModelConfig
    permuted_qk: bool  # llama.cpp's converter permuted attn_q/attn_k rows for its interleaved RoPE


def open_gguf(path: str) -> GGUFFile:
    try:
        header = read_gguf(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    cfg = config_from_metadata(header.meta, path)
    return GGUFFile(header.tensors, header.meta, cfg, ARCHITECTURES[header.meta["general.architecture"]][1])
