"""Load a Hugging Face model folder: config.json + *.safetensors (+ tokenizer files).

Weights keep their HF names; `LlamaForCausalLM` fuses them. The config comes from
hf_config.py and the tokenizer from hf_tokenizer.py; a folder without tokenizer.json
loads weight-only (tokenizer None), which tests use.
"""

from __future__ import annotations

import glob
import os
import sys

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine_native.model.base import LoadedModel
from engine_native.model.errors import ModelLoadError
from engine_native.model.hf_config import config_from_hf, read_json_object
from engine_native.model.hf_tokenizer import load_hf_tokenizer
from engine_native.model.llama import LlamaForCausalLM


def load_hf_folder(path: str, dtype: torch.dtype, progress: bool = True) -> LoadedModel:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path} has no config.json (found: {sorted(os.listdir(path))[:10]})")
    raw = read_json_object(config_path)
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
