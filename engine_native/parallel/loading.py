"""Load one tensor-parallel rank's slice of a model, a tensor at a time.

A rank never holds the whole model: a Hugging Face folder is read through safetensors' slices
(only the rows/columns of this rank leave the disk); of a GGUF file only the rank's rows (and
block-aligned columns) of each tensor are dequantized, one tensor at a time. Names, the q/k un-permutation
of llama.cpp files and the config come from the single-process loaders.
"""

from __future__ import annotations

import glob
import os
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors import safe_open

from engine_native.config import ModelConfig
from engine_native.model.base import LoadedModel
from engine_native.model.errors import ModelLoadError, ModelNotFoundError
from engine_native.model.gguf_config import open_gguf
from engine_native.model.gguf_loader import (
    SUPPORTED_TENSOR_TYPES,
    _llama3_from_rope_freqs,
    gguf_name_to_hf,
    unpermute_qk,
)
from engine_native.model.gguf_tokenizer import tokenizer_from_gguf
from engine_native.model.hf_config import config_from_hf, read_json_object
from engine_native.model.hf_tokenizer import load_hf_tokenizer
from engine_native.parallel.comm import CollectiveClock
from engine_native.parallel.placement import Placement
from engine_native.parallel.sharding import ShardPlan, SliceReader
from engine_native.parallel.tp_model import TensorParallelLlama


def load_shard(
    path: str, dtype: torch.dtype, placement: Placement, clock: CollectiveClock, with_tokenizer: bool
) -> LoadedModel:
    """The `TensorParallelLlama` of the rank at `placement`; `LoadedModel.config` is the full model's."""
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _load_gguf_shard(path, dtype, placement, clock, with_tokenizer)
    if os.path.isdir(path):
        return _load_hf_shard(path, dtype, placement, clock, with_tokenizer)
    raise ModelNotFoundError(f"model path not found: {path}")


def _plan(cfg: ModelConfig, placement: Placement) -> ShardPlan:
    if not 1 <= placement.pp <= cfg.num_layers:
        raise ModelLoadError(f"pipeline_parallel_size {placement.pp} must be between 1 and the {cfg.num_layers} layers")
    return ShardPlan(cfg, replace(placement, num_layers=cfg.num_layers))


def _build(
    cfg: ModelConfig, shards: dict[str, torch.Tensor], dtype: torch.dtype, plan: ShardPlan, clock: CollectiveClock
) -> TensorParallelLlama:
    if "lm_head.weight" not in shards and not cfg.tie_word_embeddings and plan.placement.rank == 0:
        raise ModelLoadError("no lm_head.weight and tie_word_embeddings is false")
    return TensorParallelLlama(plan.local_config, shards, dtype, plan.placement, clock)


def _load_hf_shard(
    path: str, dtype: torch.dtype, placement: Placement, clock: CollectiveClock, with_tokenizer: bool
) -> LoadedModel:
    raw = read_json_object(os.path.join(path, "config.json"))
    cfg = config_from_hf(raw, path)
    plan = _plan(cfg, placement)
    shards: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 -- safe_open is not a dict
                if plan.keeps(name):
                    shards[name] = plan.shard(name, _safetensors_reader(handle.get_slice(name))).to(dtype)
    if not shards:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    tokenizer = load_hf_tokenizer(path, raw) if with_tokenizer else None
    model = _build(cfg, shards, dtype, plan, clock)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, dtype=dtype, source=path)


def _safetensors_reader(sl: Any) -> SliceReader:
    def read(rows: slice, cols: slice) -> torch.Tensor:
        t: torch.Tensor = sl[rows] if len(sl.get_shape()) == 1 else sl[rows, cols]
        return t

    return read


def _gguf_reader(t: Any, unpermute_head_dim: int) -> SliceReader:
    """Reads a slice of a GGUF tensor, dequantizing only that slice: rows always (rows are output
    features, whole blocks each), columns too where they fall on block boundaries. q/k rows are
    un-permuted per head (llama.cpp's permutation stays within a head, and slices are whole heads)."""
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]

    def read(rows: slice, cols: slice) -> torch.Tensor:
        raw = t.data[rows]
        if raw.ndim == 2 and block > 1 and (cols.start, cols.stop) != (None, None):
            k = raw.shape[1] // type_size * block
            lo, hi = cols.start or 0, k if cols.stop is None else cols.stop
            if lo % block == 0 and hi % block == 0:
                raw, cols = raw[:, lo // block * type_size : hi // block * type_size], slice(None)
        array = np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)
        if unpermute_head_dim:
            array = unpermute_qk(array, array.shape[0] // unpermute_head_dim)
        if array.ndim == 2:
            array = array[:, cols]
        return torch.from_numpy(np.array(array))  # a copy: owned, writeable, contiguous

    return read


def _load_gguf_shard(
    path: str, dtype: torch.dtype, placement: Placement, clock: CollectiveClock, with_tokenizer: bool
) -> LoadedModel:
    tensors, meta, cfg, permuted = open_gguf(path)
    names = {gguf_name_to_hf(t.name) for t in tensors}
    updates: dict[str, Any] = {"tie_word_embeddings": "lm_head.weight" not in names}
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is not None and int(embed.shape[-1]) != cfg.vocab_size:  # gguf shapes are (cols, rows)
        updates["vocab_size"] = int(embed.shape[-1])
    cfg = replace(cfg, **updates)
    plan = _plan(cfg, placement)
    shards: dict[str, torch.Tensor] = {}
    rope_freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        array = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float32)
        cfg = replace(cfg, rope_scaling=_llama3_from_rope_freqs(cfg, array, path))
        plan = _plan(cfg, placement)
    for t in tensors:
        name = gguf_name_to_hf(t.name)
        if name is None or not plan.keeps(name):
            continue
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"tensor {t.name} has unsupported type {t.tensor_type.name}")
        qk = permuted and (".attn_q." in t.name or ".attn_k." in t.name)
        shards[name] = plan.shard(name, _gguf_reader(t, cfg.head_dim if qk else 0)).to(dtype)
    tokenizer = tokenizer_from_gguf(meta) if with_tokenizer and "tokenizer.ggml.tokens" in meta else None
    model = _build(cfg, shards, dtype, plan, clock)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, dtype=dtype, source=path)
