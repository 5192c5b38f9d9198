"""Attention over the paged KV cache, for a step that mixes prefill chunks and decodes.

`AttentionPlan` is built once per forward from the `ForwardBatch` (it is the same
for every layer); `paged_attention` runs one layer with it:

  * every decode (query_len == 1) of the step is handled by ONE call: with an
    fp32 cache, Sluice's C++ kernel (kernels/paged_attention.cpp) walks each
    sequence's block table in place; otherwise their blocks are gathered to
    [B, L_max, Hkv, D] and a length mask hides the padding;
  * each prefill chunk attends to its cached context plus its own tokens
    causally: with a bf16 cache on an AVX-512 CPU, every chunk of the step in
    ONE call of Sluice's kernel (kernels/prefill_attention.cpp: split-bf16 tile
    products with AMX, fp32 FMAs without; fp32's accuracy either way); otherwise
    one SDPA call per sequence (chunks are few and long). The sdpa backend
    (attention_backends.py) runs its chunks through the same `prefill_chunks` /
    `prefill_chunk_attention`.

New K/V are written to the cache before attention, so "cached context" and "new
tokens" are read the same way, through the block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_native.forward_batch import ForwardBatch
from engine_native.kernels import cpu_kernels


@dataclass
class PrefillChunk:
    start: int  # first index into the step's T tokens
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)]
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when plain causal


def prefill_chunks(batch: ForwardBatch, device: torch.device | None = None) -> list[PrefillChunk]:
    """The step's sequences that compute more than one token, with their masks made on `device`
    (None: torch's default one)."""
    bs = batch.block_size
    chunks: list[PrefillChunk] = []
    for i, (start, qlen, ctx) in enumerate(
        zip(batch.query_starts, batch.query_lens, batch.context_lens, strict=True)
    ):
        if qlen <= 1:
            continue
        nblocks = -(-ctx // bs)
        mask = None
        if ctx != qlen:
            # Query j sits at position ctx - qlen + j and sees keys 0..that position.
            q_pos = torch.arange(ctx - qlen, ctx, device=device).unsqueeze(1)
            mask = torch.arange(ctx, device=device).unsqueeze(0) <= q_pos
        chunks.append(PrefillChunk(start, qlen, ctx, batch.block_tables[i, :nblocks], mask))
    return chunks


def prefill_kernel_fits(k_cache: torch.Tensor) -> bool:
    """Whether the prefill chunks' fp32 attention over this layer's cache can run in Sluice's kernel: a bf16
    cache on the CPU, a head_dim that is a multiple of 32, and the kernels built (it has a path on every build:
    AMX, AVX-512 or AVX2 FMAs)."""
    if k_cache.device.type != "cpu" or k_cache.dtype != torch.bfloat16 or k_cache.shape[-1] % 32 != 0:
        return False
    return cpu_kernels() is not None


@dataclass
class PrefillKernelArgs:
    """The step's prefill chunks as Sluice's kernel takes them, built once per forward."""

    starts: torch.Tensor  # [C] int64: each chunk's first row in the step's T tokens
    query_lens: torch.Tensor  # [C] int64
    context_lens: torch.Tensor  # [C] int64: its own tokens included
    block_tables: torch.Tensor  # [C, max_blocks] int64

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> PrefillKernelArgs | None:
        seqs = [i for i, q in enumerate(batch.query_lens) if q > 1]
        if not seqs:
            return None
        bs = batch.block_size
        nb_max = max(-(-batch.context_lens[i] // bs) for i in seqs)
        return cls(
            torch.tensor([batch.query_starts[i] for i in seqs], dtype=torch.long),
            torch.tensor([batch.query_lens[i] for i in seqs], dtype=torch.long),
            torch.tensor([batch.context_lens[i] for i in seqs], dtype=torch.long),
            batch.block_tables[torch.tensor(seqs, dtype=torch.long), :nb_max].contiguous(),
        )


@dataclass
class AttentionPlan:
    num_tokens: int
    block_size: int
    decode_token_index: torch.Tensor | None  # [B] indices into T; None when no decodes
    decode_block_tables: torch.Tensor | None  # [B, nb_max]
    decode_context_lens: torch.Tensor | None  # [B] int64
    # Only for the PyTorch path (no kernel, or a non-fp32 cache):
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb_max * block_size] bool, True = attend
    decode_bias: torch.Tensor | None  # [B, 1, L]: the same mask as an additive fp32 bias (0 / -inf)
    decodes_are_whole_batch: bool  # the step is pure decode in order: no scatter needed
    prefills: list[PrefillChunk]
    prefill_dtype: torch.dtype  # what the prefill chunks' attention computes in
    prefill_kernel: PrefillKernelArgs | None = None  # set: the prefill chunks go to Sluice's kernel

    @classmethod
    def from_batch(
        cls, batch: ForwardBatch, decode_kernel: bool = False, prefill_dtype: torch.dtype = torch.float32,
        prefill_kernel: bool = False,
    ) -> AttentionPlan:
        """`decode_kernel`: the decodes will run in the C++ kernel, which needs no mask.
        `prefill_dtype`: see `EngineConfig.prefill_attention_dtype`. `prefill_kernel`: fp32 prefill chunks
        run in Sluice's kernel (the caller checked `prefill_kernel_fits`)."""
        bs = batch.block_size
        decode_seqs = [i for i, q in enumerate(batch.query_lens) if q == 1]
        kernel_args = (
            PrefillKernelArgs.from_batch(batch) if prefill_kernel and prefill_dtype == torch.float32 else None
        )
        # The kernel takes the chunks whole: no per-chunk masks to build for it.
        prefills = prefill_chunks(batch) if kernel_args is None else []
        if not decode_seqs:
            return cls(batch.num_tokens, bs, None, None, None, None, None, False, prefills, prefill_dtype, kernel_args)
        ctx_lens = torch.tensor([batch.context_lens[i] for i in decode_seqs], dtype=torch.long)
        nb_max = -(-int(ctx_lens.max()) // bs)
        seq_index = torch.tensor(decode_seqs, dtype=torch.long)
        tables = batch.block_tables[seq_index, :nb_max].contiguous()
        token_index = torch.tensor([batch.query_starts[i] for i in decode_seqs], dtype=torch.long)
        whole = len(decode_seqs) == batch.num_tokens  # decodes only: T == B, in order
        if decode_kernel:
            return cls(batch.num_tokens, bs, token_index, tables, ctx_lens, None, None, whole, prefills, prefill_dtype,
                       kernel_args)
        key_pos = torch.arange(nb_max * bs)
        mask = (key_pos.unsqueeze(0) < ctx_lens.unsqueeze(1)).view(len(decode_seqs), 1, 1, -1)
        bias = (
            torch.zeros(mask.shape, dtype=torch.float32)
            .masked_fill_(~mask, float("-inf"))
            .view(len(decode_seqs), 1, -1)
        )
        return cls(batch.num_tokens, bs, token_index, tables, ctx_lens, mask, bias, whole, prefills, prefill_dtype,
                   kernel_args)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the step's new K/V [T, Hkv, D] at their flat slots."""
    num_blocks, block_size, hkv, d = k_cache.shape
    k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """q [T, H, D] -> attention output [T, H, D] over each sequence's cached K/V."""
    if plan.decodes_are_whole_batch:
        return _decode_attention(q, k_cache, v_cache, plan)
    out = torch.empty_like(q)
    if plan.decode_token_index is not None:
        out[plan.decode_token_index] = _decode_attention(q[plan.decode_token_index], k_cache, v_cache, plan)
    args = plan.prefill_kernel
    if args is not None:
        kernels = cpu_kernels()
        assert kernels is not None
        kernels.prefill_attention_kernel(q.contiguous(), k_cache, v_cache, args.starts, args.query_lens,
                                      args.context_lens, args.block_tables, q.shape[-1] ** -0.5, out)
        return out
    for chunk in plan.prefills:
        # fp32 by default, as the decode kernel computes: a request recomputed after preemption or
        # failover then continues with the same greedy tokens. In a bf16 cache's dtype it is ~2x faster
        # with AMX, but its rounded q and probabilities flipped a greedy token after a failover
        # (tests/fleet/test_fleet_bundled.py): an opt-in (EngineConfig.prefill_attention_dtype).
        out[chunk.start : chunk.start + chunk.query_len] = prefill_chunk_attention(
            q, k_cache, v_cache, chunk, plan.prefill_dtype
        )
    return out


def prefill_chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """The chunk's rows of q [T, H, D] attending to its cached context (its own tokens included,
    causally) -> [query_len, H, D] in q's dtype. q, K and V are cast to `compute_dtype` first: each
    caller keeps its own numerics (the native path fp32, the sdpa backend the cache's dtype)."""
    _, _, hkv, d = k_cache.shape
    qs = q[chunk.start : chunk.start + chunk.query_len].transpose(0, 1).unsqueeze(0).to(compute_dtype)
    k = k_cache.index_select(0, chunk.block_ids).view(-1, hkv, d)[: chunk.context_len].to(compute_dtype)
    v = v_cache.index_select(0, chunk.block_ids).view(-1, hkv, d)[: chunk.context_len].to(compute_dtype)
    o = F.scaled_dot_product_attention(
        qs,
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).to(q.dtype)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """q [B, H, D], one query per sequence -> [B, H, D], one batched kernel for all of them."""
    assert plan.decode_block_tables is not None and plan.decode_context_lens is not None
    _, _, hkv, d = k_cache.shape
    if plan.decode_bias is None:  # the plan was made for Sluice's kernel (fp32 q and cache)
        kernels = cpu_kernels()
        assert kernels is not None
        return kernels.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, plan.decode_block_tables, plan.decode_context_lens, d**-0.5
        )
    b, h, _ = q.shape
    # index_select of whole blocks (contiguous bs*Hkv*D runs) is ~2x faster than advanced indexing.
    flat = plan.decode_block_tables.view(-1)
    k = k_cache.index_select(0, flat).view(b, -1, hkv, d)
    v = v_cache.index_select(0, flat).view(b, -1, hkv, d)
    k = k.to(q.dtype).view(b, -1, hkv * d)
    v = v.to(q.dtype).view(b, -1, hkv * d)
    # Grouped-query attention as two plain bmm's over the gathered [B, L, Hkv*D] K/V with no
    # transpose copy: q is spread into a block-diagonal [H, Hkv*D] matrix (head h only sees
    # the D columns of its KV head). It wastes Hkv-fold FLOPs on tiny matrices, which is far
    # cheaper on CPU than materialising K^T or repeating K/V per query head.
    g = h // hkv
    q_bd = q.new_zeros(b, hkv, g, hkv, d)
    q_bd.diagonal(dim1=1, dim2=3).copy_(q.view(b, hkv, g, d).permute(0, 2, 3, 1))
    # [B, H, L]: softmax over the last, contiguous dim is ~10x faster than over a strided one.
    scores = torch.bmm(q_bd.view(b, h, hkv * d), k.transpose(1, 2))
    scores = scores.float().mul_(d**-0.5).add_(plan.decode_bias)
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.bmm(probs, v)  # [B, H, Hkv*D]; head h wants the block of its own KV head
    return out.view(b, hkv, g, hkv, d).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, h, d)
