"""Our paged-KV forward against Hugging Face's full-sequence forward on tiny random models."""

from __future__ import annotations

import itertools
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

from pathlib import Path

import pytest
import torch
from test_model_support import PagedSequences
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from engine_native.model.base import LoadedModel
from engine_native.model.loader import load_model

ATOL = 1e-4

_COMMON: dict = dict(  # noqa: C408
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
VARIANTS = {
    "llama": (
        HFLlama,
        LlamaConfig(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    "llama3_rope_tied": (
        HFLlama,
        LlamaConfig(
            **_COMMON,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2": (HFQwen2, Qwen2Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def _save(tmp_path: Path, variant: str) -> tuple[torch.nn.Module, LoadedModel]:
    torch.manual_seed(0)
    cls, cfg = VARIANTS[variant]
    hf = cls(cfg).eval()
    if variant == "qwen2":  # random init leaves biases at zero; make them count
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    return hf, load_model(str(tmp_path), dtype=torch.float32, progress=False)


def _reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_whole_prompt_prefill_matches_hf(tmp_path: Path, variant: str) -> None:
    hf, ours = _save(tmp_path, variant)
    assert ours.config.tie_word_embeddings == (variant == "llama3_rope_tied")
    ids = _prompt(37, 1)
    seqs = PagedSequences(ours.config, num_blocks=16, block_size=4, dtype=torch.float32)
    logits = ours.model.forward(seqs.step([(0, ids)]), seqs.cache)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _reference(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_prefill_then_decode_matches_hf(tmp_path: Path, variant: str) -> None:
    hf, ours = _save(tmp_path, variant)
    ids = _prompt(45, 2)
    ref = _reference(hf, ids)
    seqs = PagedSequences(ours.config, num_blocks=32, block_size=4, dtype=torch.float32, seed=3)
    # Chunk edges inside and on block boundaries, then single-token decodes.
    edges = [0, 7, 8, 21, 40, 41, 42, 43, 44, 45]
    for a, b in itertools.pairwise(edges):
        logits = ours.model.forward(seqs.step([(0, ids[a:b])]), seqs.cache)
        torch.testing.assert_close(logits, ref[a:b], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_mixed_batch_of_prefill_chunk_and_decodes(tmp_path: Path, variant: str) -> None:
    hf, ours = _save(tmp_path, variant)
    prompts = {s: _prompt(20 + 7 * s, 10 + s) for s in range(4)}
    refs = {s: _reference(hf, p) for s, p in prompts.items()}
    seqs = PagedSequences(ours.config, num_blocks=64, block_size=4, dtype=torch.float32, seed=5)
    # Sequences 1..3 get their first n-1 tokens prefilled; sequence 0 starts with a partial chunk.
    for s in (1, 2, 3):
        ours.model.forward(seqs.step([(s, prompts[s][:-2])]), seqs.cache)
    ours.model.forward(seqs.step([(0, prompts[0][:5])]), seqs.cache)
    # One step: seq 2 decodes, seq 0 continues its prefill (cached context + new), seqs 3 and 1 decode.
    work = [
        (2, [prompts[2][-2]]),
        (0, prompts[0][5:16]),
        (3, [prompts[3][-2]]),
        (1, [prompts[1][-2]]),
    ]
    logits = ours.model.forward(seqs.step(work), seqs.cache)
    expected = torch.cat([refs[2][-2:-1], refs[0][5:16], refs[3][-2:-1], refs[1][-2:-1]])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # A pure-decode step in shuffled order, only last-token logits.
    order = [3, 0, 2, 1]
    work = [(s, [prompts[s][16] if s == 0 else prompts[s][-1]]) for s in order]
    logits = ours.model.forward(seqs.step(work, last_only=True), seqs.cache)
    expected = torch.stack([refs[0][16] if s == 0 else refs[s][-1] for s in order])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_bfloat16_load_is_close_to_fp32(tmp_path: Path) -> None:
    hf, _ = _save(tmp_path, "llama")
    ours16 = load_model(str(tmp_path), dtype=torch.bfloat16, progress=False)
    ids = _prompt(30, 4)
    seqs = PagedSequences(ours16.config, num_blocks=16, block_size=8, dtype=torch.bfloat16)
    logits = ours16.model.forward(seqs.step([(0, ids)]), seqs.cache)
    assert logits.dtype == torch.float32
    ref = _reference(hf, ids)
    assert (logits - ref).abs().max() < 0.1
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
