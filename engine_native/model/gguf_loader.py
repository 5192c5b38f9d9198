"""Load a llama.cpp GGUF file: its header (gguf_config.py) -> ModelConfig, tensors -> dequantized HF-named weights.

Quantized tensors are dequantized once at load: the model runs dense in fp32 or bf16. Q4_1 and
Q8_0 tensors also keep their blocks (model/quant.py), which steps of a few tokens multiply by
directly. llama.cpp's converter stores attn_q/attn_k of the `llama` arch with
rows permuted for its interleaved RoPE; we permute them back to Hugging Face's
rotate-half layout, as transformers' GGUF integration does.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from engine_native.config import ModelConfig
from engine_native.model.base import LoadedModel
from engine_native.model.errors import ModelLoadError
from engine_native.model.gguf_config import open_gguf
from engine_native.model.gguf_file import GGUFTensor
from engine_native.model.gguf_tokenizer import tokenizer_from_gguf
from engine_native.model.llama import LlamaForCausalLM
from engine_native.model.quant import QuantWeight, q4_1_from_gguf, q8_0_from_gguf
from engine_native.model.quant import dequantize as dequantize_blocks
from engine_native.model.rope import inverse_frequencies

Q = GGMLQuantizationType
# The six first are exercised by our tests; the K-quants go through gguf's numpy reference code.
SUPPORTED_TENSOR_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_name_to_hf(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors we skip."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`: rows (head, pair, half) back to (head, half, pair)."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's permutation (HF -> GGUF layout); the inverse of `unpermute_qk`."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_from_rope_freqs(cfg: ModelConfig, rope_freqs: np.ndarray, name: str) -> dict[str, float | str]:
    # Llama 3.1+ GGUFs store the llama3 scaling as a per-frequency divisor tensor instead of
    # metadata. Recognise Meta's standard parameters; anything else we cannot reproduce.
    candidate: dict[str, float | str] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    base = inverse_frequencies(cfg.head_dim, cfg.rope_theta, None)
    for factor in (8.0, 32.0, 16.0, 4.0):
        candidate["factor"] = factor
        divisor = (base / inverse_frequencies(cfg.head_dim, cfg.rope_theta, candidate)).numpy()
        if np.allclose(divisor, rope_freqs.astype(np.float64), rtol=1e-3):
            return dict(candidate)
    raise ModelLoadError(f"{name}: rope_freqs tensor does not match any llama3 scaling we support")


def load_gguf(path: str, dtype: torch.dtype, progress: bool = True) -> LoadedModel:
    tensors, meta, cfg, permuted = open_gguf(path)

    weights: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantWeight] = {}
    rope_freqs: np.ndarray | None = None
    for t in tqdm(
        tensors,
        desc=f"loading {os.path.basename(path)}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    ):
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"tensor {t.name} has unsupported type {t.tensor_type.name} in {path}")
        if t.name == "rope_freqs.weight":
            rope_freqs = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            continue
        hf_name = gguf_name_to_hf(t.name)
        if hf_name is None:
            continue
        heads = 0
        if permuted and ".attn_q." in t.name:
            heads = cfg.num_heads
        elif permuted and ".attn_k." in t.name:
            heads = cfg.num_kv_heads
        raw = _blocks(t)
        if raw is not None:
            # The blocks' own dequantization gives gguf-py's values exactly (tests/engine/test_quant.py) in a
            # quarter of its numpy code's time; un-permuting rows commutes with it.
            blocks[hf_name] = raw.rows(_unpermuted_rows(raw.shape[0], heads)) if heads else raw
            weights[hf_name] = dequantize_blocks(blocks[hf_name]).to(dtype)
            continue
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if heads:
            array = unpermute_qk(array, heads)
        if not array.flags.writeable:  # F32 tensors are read-only views of the memory-mapped file
            array = array.copy()
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)

    updates: dict[str, Any] = {"tie_word_embeddings": "lm_head.weight" not in weights}
    if rope_freqs is not None:
        updates["rope_scaling"] = _llama3_from_rope_freqs(cfg, rope_freqs, path)
    embed = weights.get("model.embed_tokens.weight")
    if embed is not None and embed.shape[0] != cfg.vocab_size:
        updates["vocab_size"] = int(embed.shape[0])
    cfg = replace(cfg, **updates)
    model = LlamaForCausalLM(cfg, weights, dtype, blocks)
    tokenizer = tokenizer_from_gguf(meta) if "tokenizer.ggml.tokens" in meta else None
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, dtype=dtype, source=path)


def _blocks(t: GGUFTensor) -> QuantWeight | None:
    """The tensor's quantized blocks in the kernels' layout, for the formats they read."""
    if t.tensor_type == Q.Q4_1 and len(t.data.shape) == 2:
        return q4_1_from_gguf(t.data)
    if t.tensor_type == Q.Q8_0 and len(t.data.shape) == 2:
        return q8_0_from_gguf(t.data)
    return None


def _unpermuted_rows(num_rows: int, n_head: int) -> torch.Tensor:
    """Row order that `unpermute_qk` gives, as indices, to reorder quantized rows the same way."""
    index = np.arange(num_rows).reshape(num_rows, 1)
    return torch.from_numpy(unpermute_qk(index, n_head).reshape(-1).copy())


__all__ = [
    "load_gguf",
    "permute_qk",
    "unpermute_qk",
]
