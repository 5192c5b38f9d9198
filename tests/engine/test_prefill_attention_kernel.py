"""The prefill chunks' attention in Sluice's kernel (kernels/prefill_attention.cpp), on each path this CPU and
build have: AMX (q and the probabilities split in three bf16 parts each), AVX-512 and AVX2 fp32 FMAs. Each lands
within fp32-like error of exact attention, causal within each chunk over its cached context, every chunk of a
step in one call."""

from __future__ import annotations

import pytest
import torch

from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.engine import LLMEngine
from engine_native.forward_batch import ForwardBatch
from engine_native.kernels import cpu_kernels
from engine_native.model.attention import (
    AttentionPlan,
    prefill_chunk_attention,
    prefill_chunks,
    prefill_kernel_fits,
)
from engine_native.model.bundled import bundled_model_path
from engine_native.sampling_params import SamplingParams

# No skip where they are missing: they build on every host CI runs on (tests/engine/test_quant.py asserts it), so
# a missing kernel fails these tests rather than passing nothing.
_KERNELS = cpu_kernels()
# The kernel's paths on this CPU and build, fastest first: "avx2" everywhere, "avx512" and "amx" where they run.
PATHS = _KERNELS.prefill_attention_paths() if _KERNELS is not None else ["avx2"]

Chunk = tuple[int, int, int, torch.Tensor]  # start row, query length, context length, block ids


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor:
    """Exact causal attention in float64, each chunk's query j at position ctx - qlen + j."""
    _, _, hkv, d = kc.shape
    h = q.shape[1]
    out = torch.zeros_like(q, dtype=torch.float64)
    for start, qlen, ctx, blocks in chunks:
        k = kc[blocks].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(h // hkv, 1)
        v = vc[blocks].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(h // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[start : start + qlen].double(), k) * d**-0.5
        visible = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - qlen, ctx).unsqueeze(1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return out


def _sdpa_fp32(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor:
    """What the engine computed before the kernel: model/attention.py's PyTorch fp32 SDPA, chunk by chunk."""
    tables = torch.zeros(len(chunks), max(len(c[3]) for c in chunks), dtype=torch.long)
    for i, c in enumerate(chunks):
        tables[i, : len(c[3])] = c[3]
    batch = ForwardBatch(
        input_ids=torch.zeros(0, dtype=torch.long), positions=torch.zeros(0, dtype=torch.long),
        slot_mapping=torch.zeros(0, dtype=torch.long), query_starts=[c[0] for c in chunks],
        query_lens=[c[1] for c in chunks], context_lens=[c[2] for c in chunks], block_tables=tables,
        logits_indices=torch.zeros(0, dtype=torch.long), block_size=kc.shape[1],
    )
    out = torch.zeros_like(q)
    for chunk in prefill_chunks(batch):
        out[chunk.start : chunk.start + chunk.query_len] = prefill_chunk_attention(q, kc, vc, chunk, torch.float32)
    return out


def _kernel(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunks: list[Chunk], out: torch.Tensor, path: str = ""
) -> None:
    assert _KERNELS is not None
    tables = torch.zeros(len(chunks), max(len(c[3]) for c in chunks), dtype=torch.long)
    for i, c in enumerate(chunks):
        tables[i, : len(c[3])] = c[3]
    _KERNELS.prefill_attention_kernel(
        q, kc, vc, torch.tensor([c[0] for c in chunks]), torch.tensor([c[1] for c in chunks]),
        torch.tensor([c[2] for c in chunks]), tables, q.shape[-1] ** -0.5, out, path=path,
    )


def _case(heads: int, kv_heads: int, d: int, specs: list[tuple[int, int]], seed: int):
    """Chunks (query length, context length) with scattered blocks and a gap of rows between chunks."""
    g = torch.Generator().manual_seed(seed)
    bs, num_blocks = 16, 200
    kc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).bfloat16()
    vc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, generator=g)
    chunks: list[Chunk] = []
    row = used = 0
    for qlen, ctx in specs:
        nb = -(-ctx // bs)
        chunks.append((row, qlen, ctx, perm[used : used + nb]))
        used += nb
        row += qlen + 3
    q = torch.randn(row + 2, heads, d, generator=g) * 3  # sharp softmaxes too
    return q, kc, vc, chunks


# (9, 3, 64) is SmolLM2's; (4, 4, 32) no grouping; (8, 2, 128) four query heads a KV head, two 64-column
# halves of P.V per pass. Chunks: whole prompts, chunks over a cached context, lengths off every tile size.
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize(
    "specs",
    [[(128, 128)] * 3, [(2, 2), (17, 40), (5, 5), (33, 33)], [(256, 700), (31, 31)], [(1, 9), (16, 16)]],
    ids=["prompts", "mixed", "long-context", "one-row"],
)
def test_kernel_matches_exact_attention_about_as_closely_as_fp32(
    heads: int, kv_heads: int, d: int, specs: list[tuple[int, int]], path: str
) -> None:
    q, kc, vc, chunks = _case(heads, kv_heads, d, specs, seed=heads * d + len(specs))
    exact = _reference(q, kc, vc, chunks)
    out = torch.full_like(q, 7.0)
    _kernel(q, kc, vc, chunks, out, path)
    rows = torch.cat([torch.arange(c[0], c[0] + c[1]) for c in chunks])
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0), "rows outside the chunks must stay untouched"
    err = (out.double() - exact)[rows].abs().max().item()
    fp32_err = (_sdpa_fp32(q, kc, vc, chunks).double() - exact)[rows].abs().max().item()
    # bf16 alone would be ~2^-9 relative (errors ~1e-2 here); split in two parts ~2^-17. The FMA paths compute
    # in fp32 throughout.
    assert err < 1e-4
    assert err < 30 * fp32_err + 1e-6


def test_bad_inputs_are_refused_with_a_message() -> None:
    assert _KERNELS is not None
    q, kc, vc, chunks = _case(9, 3, 64, [(16, 32)], seed=1)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bf16"):
        _kernel(q, kc.float(), vc.float(), chunks, out)
    with pytest.raises(RuntimeError, match="out of range"):
        _kernel(q, kc, vc, [(q.shape[0] - 4, 16, 32, chunks[0][3])], out)
    with pytest.raises(RuntimeError, match="block id"):
        _kernel(q, kc, vc, [(0, 16, 32, torch.tensor([0, 10_000]))], out)
    with pytest.raises(RuntimeError, match="not built or not permitted"):
        _kernel(q, kc, vc, chunks, out, path="neon")


def _first_token_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[dict[int, float]]:
    """Each prompt's top-5 next-token logprobs, all prompts prefilled in one step."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    tops: dict[str, dict[int, float]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.logprobs:
                tops[out.request_id] = {t.token_id: t.logprob for t in out.logprobs[0].top}
    return [tops[f"p{i}"] for i in range(len(prompts))]


def test_the_engine_takes_the_kernel_by_default_and_stays_as_close_to_exact_attention_as_sdpa() -> None:
    """The bundled model, bf16 with a bf16 cache, prompts of several lengths prefilled together: the first
    token's logprobs through the kernel sit about as near those with float64 attention as PyTorch's fp32
    SDPA's do. (Neither is bit-close: any change in the attention's last bits flips some bf16 roundings of
    the next GEMM's input, which moves a logprob by a few hundredths of a nat.)"""
    config = EngineConfig(
        model_path=str(bundled_model_path()), dtype="bfloat16",
        cache=CacheConfig(block_size=16, num_blocks=400, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
    )
    engine = LLMEngine(config, progress=False)
    model = engine.loaded.model
    assert prefill_kernel_fits(engine.runner.kv_cache.k[0]) and model.prefill_attention_kernel_on
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40_000, (n,), generator=g).tolist() for n in (150, 37, 90, 9)]
    kernel = _first_token_logprobs(engine, prompts)
    model.prefill_attention_kernel_on = False
    sdpa = _first_token_logprobs(engine, prompts)
    model.prefill_attention_dtype = torch.float64  # the PyTorch path then attends in float64
    exact = _first_token_logprobs(engine, prompts)
    model.prefill_attention_dtype, model.prefill_attention_kernel_on = torch.float32, True

    def gap(a: dict[int, float], b: dict[int, float]) -> float:
        return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())

    kernel_gaps = [gap(k, x) for k, x in zip(kernel, exact, strict=True)]
    sdpa_gaps = [gap(s, x) for s, x in zip(sdpa, exact, strict=True)]
    assert max(kernel_gaps) < 0.15 and max(sdpa_gaps) < 0.15
    assert sum(kernel_gaps) < 2 * sum(sdpa_gaps) + 0.05


def test_the_plan_hands_prefills_to_the_kernel_only_in_fp32() -> None:
    """Two prompt chunks (one over a cached context) and a decode: the kernel gets the two chunks."""
    batch = ForwardBatch(
        input_ids=torch.zeros(21, dtype=torch.long), positions=torch.zeros(21, dtype=torch.long),
        slot_mapping=torch.zeros(21, dtype=torch.long), query_starts=[0, 10, 20], query_lens=[10, 10, 1],
        context_lens=[10, 25, 31], block_tables=torch.tensor([[0, 0], [1, 4], [2, 3]]),
        logits_indices=torch.tensor([9, 19, 20]), block_size=16,
    )
    plan = AttentionPlan.from_batch(batch, decode_kernel=True, prefill_kernel=True)
    assert plan.prefill_kernel is not None
    assert plan.prefill_kernel.starts.tolist() == [0, 10]
    assert plan.prefill_kernel.query_lens.tolist() == [10, 10]
    assert plan.prefill_kernel.context_lens.tolist() == [10, 25]
    assert plan.prefill_kernel.block_tables.tolist() == [[0, 0], [1, 4]]
    assert AttentionPlan.from_batch(batch, decode_kernel=True).prefill_kernel is None
    bf16 = AttentionPlan.from_batch(batch, decode_kernel=True, prefill_dtype=torch.bfloat16, prefill_kernel=True)
    assert bf16.prefill_kernel is None


@pytest.mark.parametrize("path", PATHS)
def test_how_the_work_is_split_over_threads_changes_no_bit(path: str) -> None:
    """Row tiles go to the threads by the keys they see (kernels/balance.h), a tile whole to one thread: a step of
    chunks of very different contexts gives the same bits on one thread as on several."""
    q, kc, vc, chunks = _case(9, 3, 64, [(256, 900), (3, 3), (40, 300), (256, 256), (1, 700)], seed=5)
    threads = torch.get_num_threads()
    several = torch.zeros_like(q)
    _kernel(q, kc, vc, chunks, several, path)
    one = torch.zeros_like(q)
    torch.set_num_threads(1)
    try:
        _kernel(q, kc, vc, chunks, one, path)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(several, one)
    assert several.abs().sum() > 0
