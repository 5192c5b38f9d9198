"""The attention seam on CPU: `sdpa` (torch SDPA over gathered blocks, the CUDA fallback backend)
against Hugging Face and against the native CPU path, and the padded decode batch a CUDA graph
replays (cuda_graphs.pad_decode_batch), which must not change the real rows' logits."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_model_support import PagedSequences
from tiny_models import load_tiny_llama, prompt

from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.cuda_graphs import bucket_for, pad_decode_batch
from engine_native.engine import LLMEngine
from engine_native.model.attention_backends import SdpaAttention
from engine_native.model.base import LoadedModel
from engine_native.sampling_params import SamplingParams

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-llama")


@pytest.fixture
def tiny(tiny_path: Path) -> LoadedModel:
    return load_tiny_llama(tiny_path)  # a fresh model per test: an engine sets its attention backend


def test_sdpa_logits_match_hf_over_prefill_chunks_mixed_with_decodes(tiny: LoadedModel, tiny_path: Path) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_path).eval()
    model = tiny.model
    model.attention_backend = SdpaAttention()
    a, b = prompt(21, 1), prompt(8, 2)
    seqs = PagedSequences(tiny.config, num_blocks=64, block_size=4, dtype=torch.float32, seed=3)
    steps = [  # seq 0 prefills in chunks while seq 1 prefills, then decodes; the last step is pure decode
        [(0, a[0:7]), (1, b[0:5])],
        [(0, a[7:14]), (1, b[5:6])],
        [(0, a[14:20]), (1, b[6:7])],
        [(0, a[20:21]), (1, b[7:8])],
    ]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    with torch.inference_mode():
        for work in steps:
            logits = model.forward(seqs.step(work), seqs.cache)
            row = 0
            for seq, toks in work:
                got[seq].append(logits[row : row + len(toks)])
                row += len(toks)
        ref_a = hf(torch.tensor([a])).logits[0]
        ref_b = hf(torch.tensor([b])).logits[0]
    torch.testing.assert_close(torch.cat(got[0]), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got[1]), ref_b, atol=ATOL, rtol=0)


def _engine(tiny: LoadedModel, backend: str) -> LLMEngine:
    config = EngineConfig(
        model_path="tiny", dtype="float32", device="cpu", attention_backend=backend,
        cache=CacheConfig(block_size=8, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=24),
    )
    return LLMEngine(config, loaded=tiny)


def test_sdpa_greedy_output_is_the_native_paths_in_fp32(tiny: LoadedModel) -> None:
    prompts = [prompt(n, seed) for n, seed in [(5, 1), (40, 2), (17, 3), (63, 4), (9, 5)]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    native = _engine(tiny, "native")
    assert native.attention_backend_name == "native" and tiny.model.attention_backend is None
    expected = native.generate(prompts, params)
    sdpa = _engine(tiny, "sdpa")
    assert sdpa.attention_backend_name == "sdpa"
    assert sdpa.generate(prompts, params) == expected
    assert sdpa.scheduler.num_prefill_chunks > 0  # prompts were split, so steps mixed chunks and decodes


def test_a_decode_batch_padded_for_a_graph_bucket_keeps_its_rows_logits(tiny: LoadedModel) -> None:
    model = tiny.model
    model.attention_backend = SdpaAttention()
    seqs = PagedSequences(tiny.config, num_blocks=32, block_size=4, dtype=torch.float32, seed=5)
    prompts = [prompt(9, 11), prompt(14, 12), prompt(3, 13)]
    scratch = seqs.free[0]  # handed out last: no table holds it
    with torch.inference_mode():
        model.forward(seqs.step(list(enumerate(prompts)), last_only=True), seqs.cache)
        decode = seqs.step([(i, [7 + i]) for i in range(3)])
        assert scratch not in [b for t in seqs.tables.values() for b in t]
        expected = model.forward(decode, seqs.cache)
        size = bucket_for(decode.num_seqs, (1, 2, 4, 8))
        assert size == 4 and bucket_for(9, (1, 2, 4, 8)) is None
        padded = pad_decode_batch(decode, size, width=8, scratch_block=scratch)
        assert padded.num_seqs == 4 and padded.block_tables.shape == (4, 8)
        got = model.forward(padded, seqs.cache)
    torch.testing.assert_close(got[:3], expected, atol=1e-5, rtol=0)


def _first_token_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[float]:
    """The top logprob of each prompt's first token: what its prefill computed."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))
    top: dict[str, float] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.logprobs
            top[out.request_id] = out.logprobs[0].top[0].logprob
    return [top[f"p{i}"] for i in range(len(prompts))]


def test_prefill_attention_in_the_kv_dtype_only_when_asked(tiny: LoadedModel) -> None:
    """`prefill_attention_dtype="kv"` reaches the prefill chunks' attention: over a bf16 cache their
    logits move by bf16 rounding, no more; the default keeps fp32; an unknown value is refused."""
    config = EngineConfig(
        model_path="tiny", dtype="float32", kv_dtype="bfloat16", device="cpu",
        cache=CacheConfig(block_size=8, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=24),
    )
    prompts = [prompt(n, seed) for n, seed in [(40, 2), (63, 4), (30, 6)]]  # split into chunks: cached context too
    exact = _first_token_logprobs(LLMEngine(config, loaded=tiny), prompts)
    assert tiny.model.prefill_attention_dtype == torch.float32
    fast = _first_token_logprobs(LLMEngine(replace(config, prefill_attention_dtype="kv"), loaded=tiny), prompts)
    assert tiny.model.prefill_attention_dtype == torch.bfloat16
    diffs = [abs(a - b) for a, b in zip(exact, fast, strict=True)]
    assert 0 < max(diffs) < 0.05, diffs
    with pytest.raises(ValueError, match="prefill_attention_dtype"):
        LLMEngine(replace(config, prefill_attention_dtype="fp16"), loaded=tiny)
