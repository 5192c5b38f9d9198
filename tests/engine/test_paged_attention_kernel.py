"""Sluice's C++ decode attention over the paged cache against plain softmax attention in float64."""

from __future__ import annotations

import pytest
import torch

from engine_native.kernels import cpu_kernels


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]],
              lens: list[int]) -> torch.Tensor:
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        k = k_cache[tables[i]].reshape(-1, hkv, d)[: lens[i]].double()  # [L, Hkv, D]
        v = v_cache[tables[i]].reshape(-1, hkv, d)[: lens[i]].double()
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * d**-0.5
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


# (10, 2, 80): five query heads per KV head and a head_dim that is not a multiple of 64 (the AVX-512
# walk takes four heads and 64 columns at a time); (6, 3, 24): not a multiple of 16 (the AVX2 walk).
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (10, 2, 80), (6, 3, 24)])
@pytest.mark.parametrize("lens", [[1, 7, 16, 17, 100, 203], [203]], ids=["batch", "alone"])
def test_kernel_matches_softmax_attention(heads: int, kv_heads: int, head_dim: int, lens: list[int]) -> None:
    """A batch is split over threads by sequence, a sequence alone by KV head: both are checked."""
    kernels = cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(heads)
    num_blocks, bs = 40, 16
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g)
    # one token, partial blocks, exact blocks, many blocks
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 3  # sharp softmaxes too
    ours = kernels.paged_decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens), head_dim**-0.5)
    torch.testing.assert_close(ours.double(), reference(q, k_cache, v_cache, tables, lens), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("lens", [[1, 7, 16, 17, 100, 203], [203]], ids=["batch", "alone"])
# Groups of three, two, four (three then one) and five (three then two) query heads per KV head.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 3, 64), (8, 2, 128), (10, 2, 80), (4, 1, 32)])
def test_a_bf16_cache_is_read_exactly(lens: list[int], heads: int, kv_heads: int, head_dim: int) -> None:
    """The kernel widens bf16 K/V to fp32 exactly: its answer over a bf16 cache is the softmax
    attention over the same values in fp32."""
    kernels = cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(7)
    num_blocks, bs = 40, 16
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 3
    ours = kernels.paged_decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens), head_dim**-0.5)
    expected = reference(q, k_cache.float(), v_cache.float(), tables, lens)
    torch.testing.assert_close(ours.double(), expected, atol=2e-5, rtol=1e-4)


def test_bad_tables_are_errors_not_crashes() -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    cache = torch.zeros(4, 16, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id"):
        kernels.paged_decode_attention(q, cache, cache, torch.tensor([[9]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        kernels.paged_decode_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([17]), 1.0)


# The AVX-512 walk (head_dim % 16 == 0) and the AVX2 one (24; every head_dim on an AVX2 build) both split by cost.
_SPLIT_CASES = [(torch.float32, 64), (torch.float32, 24), (torch.bfloat16, 64)]


@pytest.mark.parametrize("dtype,d", _SPLIT_CASES)
def test_how_the_work_is_split_over_threads_changes_no_bit(dtype: torch.dtype, d: int) -> None:
    """The kernel hands (sequence, KV head) items to the threads by context length (kernels/balance.h), so on
    mixed lengths a range can end inside a sequence. Each item is still computed whole by one thread: a batch
    gives the same bits on one thread as on several, and as each of its sequences alone."""
    kernels = cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, bs = 9, 3, 16
    lens = [900, 3, 40, 700, 5, 1, 300, 17]
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(len(lens), heads, d, generator=g) * 3
    run = lambda rows: kernels.paged_decode_attention(
        q[rows].contiguous(), k_cache, v_cache, padded[rows].contiguous(), torch.tensor(lens)[rows], d**-0.5)
    threads = torch.get_num_threads()
    batch = run(slice(None))
    torch.set_num_threads(1)
    try:
        one_thread = run(slice(None))
    finally:
        torch.set_num_threads(threads)
    alone = torch.cat([run(slice(i, i + 1)) for i in range(len(lens))])
    assert torch.equal(batch, one_thread)
    assert torch.equal(batch, alone)
