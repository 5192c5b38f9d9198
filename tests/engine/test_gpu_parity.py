"""The engine on CUDA against Hugging Face on the same GPU (scripts/gpu_check.sh runs this on a lent
GPU machine; without CUDA every test here is skipped).

fp32: greedy output token-identical to Hugging Face's, alone and batched, with the sdpa backend (FlashInfer
has no fp32 kernels), with and without CUDA graphs, and through swap-to-host preemption.
bf16: Hugging Face fp32, teacher-forced on the engine's bf16 greedy output, agrees with its tokens
at least as often as it does with Hugging Face's own bf16 greedy output, minus 0.05.
Sampling runs on the device (only token ids and logprobs come back): seeded requests with every
sampling stage get the same tokens and logprobs as on the CPU engine, alone and batched.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import prompt, save_tiny_llama

from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.engine import LLMEngine
from engine_native.messages import LogprobEntry
from engine_native.model.attention_backends import flashinfer_available
from engine_native.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 24
PROMPTS = [prompt(n, seed) for n, seed in [(7, 1), (33, 2), (18, 3), (61, 4), (12, 5), (40, 6)]]
BACKENDS = ["sdpa"] + (["flashinfer"] if flashinfer_available() else [])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_llama(path)
    return path


def _hf(path: Path, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@torch.inference_mode()
def _hf_greedy(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          attention_mask=torch.ones_like(ids))
        outs.append(out[0, len(p):].tolist())
    return outs


def _engine(path: Path, dtype: str, backend: str, graphs: bool = True, device: str = "cuda", **cache: Any) -> LLMEngine:
    config = EngineConfig(
        model_path=str(path), dtype=dtype, device=device, attention_backend=backend,
        cuda_graph_batch_sizes=(1, 2, 4, 8) if graphs else (),
        cache=CacheConfig(block_size=8, **{"num_blocks": 256, **cache}),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, long_prefill_token_threshold=32),
    )
    return LLMEngine(config, progress=False)  # it loads the weights in the dtype it computes in there


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = engine.generate(prompts, params)
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return out


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_greedy_matches_hf_alone_and_batched(tiny_path: Path, graphs: bool) -> None:
    expected = _hf_greedy(_hf(tiny_path, torch.float32), PROMPTS)
    engine = _engine(tiny_path, "float32", "sdpa", graphs)
    assert engine.device.type == "cuda" and engine.attention_backend_name == "sdpa"
    assert [_run(engine, [p])[0] for p in PROMPTS] == expected
    assert _run(engine, PROMPTS) == expected


def test_fp32_swap_to_host_keeps_greedy_output(tiny_path: Path) -> None:
    expected = _hf_greedy(_hf(tiny_path, torch.float32), PROMPTS)
    tight = sum(-(-len(p) // 8) for p in PROMPTS) + 2
    engine = _engine(tiny_path, "float32", "sdpa", num_blocks=tight, preemption_mode="swap", swap_num_blocks=256)
    assert _run(engine, PROMPTS) == expected
    assert engine.scheduler.num_swaps > 0


@torch.inference_mode()
def _teacher_forced_agreement(hf32: Any, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    agree = total = 0
    for p, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([p + out], device="cuda")
        best = hf32(ids).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(best, out, strict=True))
        total += len(out)
    return agree / total


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_agrees_with_hf_fp32_as_well_as_hf_bf16_does(tiny_path: Path, backend: str) -> None:
    hf32 = _hf(tiny_path, torch.float32)
    hf_bf16_out = _hf_greedy(_hf(tiny_path, torch.bfloat16), PROMPTS)
    ours = _run(_engine(tiny_path, "auto", backend), PROMPTS)
    ours_rate = _teacher_forced_agreement(hf32, PROMPTS, ours)
    hf_rate = _teacher_forced_agreement(hf32, PROMPTS, hf_bf16_out)
    print(f"bf16 agreement with HF fp32 ({backend}): engine {ours_rate:.3f}, HF bf16 {hf_rate:.3f}")
    assert ours_rate >= hf_rate - 0.05


SAMPLED = [
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9, top_k=40, seed=12, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                   frequency_penalty=0.2, seed=13, ignore_eos=True),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2),
]


def _outputs(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
             ) -> list[tuple[list[int], list[LogprobEntry]]]:
    ids = [f"s{engine.steps}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    got: dict[str, tuple[list[int], list[LogprobEntry]]] = {rid: ([], []) for rid in ids}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    return [got[rid] for rid in ids]


def test_sampling_on_the_device_matches_the_cpu_engine_alone_and_batched(tiny_path: Path) -> None:
    prompts = PROMPTS[: len(SAMPLED)]
    cuda = _engine(tiny_path, "float32", "sdpa")
    batched = _outputs(cuda, prompts, SAMPLED)
    alone = [_outputs(cuda, [p], [sp])[0] for p, sp in zip(prompts, SAMPLED, strict=True)]
    on_cpu = _outputs(_engine(tiny_path, "float32", "native", graphs=False, device="cpu"), prompts, SAMPLED)
    assert [t for t, _ in batched] == [t for t, _ in alone] == [t for t, _ in on_cpu]
    for (_, gpu_lp), (_, cpu_lp), sp in zip(batched, on_cpu, SAMPLED, strict=True):
        assert len(gpu_lp) == len(cpu_lp) == (NEW_TOKENS if sp.logprobs is not None else 0)
        for g, c in zip(gpu_lp, cpu_lp, strict=True):
            assert g.token_id == c.token_id and abs(g.logprob - c.logprob) < 1e-3
            assert [t.token_id for t in g.top] == [t.token_id for t in c.top]
