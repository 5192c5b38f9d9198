"""The row-wise C++ steps between a layer's GEMMs (kernels/elementwise.cpp) against their PyTorch formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_native.kernels import cpu_kernels
from engine_native.model.attention import write_kv
from engine_native.model.rope import RotaryTable, apply_rotary


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    k = cpu_kernels()
    assert k is not None
    return k


def test_norms_and_activation_match_pytorch(kernels) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 33):  # below and above a thread's share of rows
        x = torch.randn(rows, 576, generator=g) * 30  # SmolLM2's residual reaches tens of thousands
        w = torch.randn(576, generator=g)
        ref = F.rms_norm(x, (576,), w, 1e-5)
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-5)
        delta = torch.randn(rows, 576, generator=g)
        summed = x + delta
        h = kernels.add_rms_norm(x, delta, w, 1e-5)
        torch.testing.assert_close(x, summed)  # in place
        torch.testing.assert_close(h, F.rms_norm(summed, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
        gate_up = torch.randn(rows, 2 * 1536, generator=g) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_rope_and_cache_writes_match_pytorch(kernels) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, t = 9, 3, 64, 7
    rope = RotaryTable(d, 2048, 10000.0, None, torch.float32)
    positions = torch.tensor([0, 1, 2, 100, 101, 2047, 5])
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    slots = torch.tensor([3, 4, 5, 40, 41, 63, 0])
    caches = [torch.zeros(4, 16, kv_heads, d) for _ in range(4)]
    q = kernels.rope_write_kv(qkv, cos.view(t, -1), sin.view(t, -1), caches[0], caches[1], slots, heads, kv_heads)
    rq, rk, rv = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    ref_q = apply_rotary(rq.view(t, heads, d), cos, sin)
    write_kv(caches[2], caches[3], apply_rotary(rk.view(t, kv_heads, d), cos, sin), rv.view(t, kv_heads, d), slots)
    torch.testing.assert_close(q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[1], caches[3])  # V is copied, not computed
    # A bf16 cache holds what PyTorch's rounding (to nearest even) makes of the same rows.
    half = [torch.zeros(4, 16, kv_heads, d, dtype=torch.bfloat16) for _ in range(4)]
    kernels.rope_write_kv(qkv, cos.view(t, -1), sin.view(t, -1), half[0], half[1], slots, heads, kv_heads)
    write_kv(half[2], half[3], caches[0].view(-1, kv_heads, d)[slots], rv.view(t, kv_heads, d), slots)
    assert torch.equal(half[0], half[2]) and torch.equal(half[1], half[3])
    with pytest.raises(RuntimeError, match="slot beyond the KV pool"):
        kernels.rope_write_kv(qkv, cos.view(t, -1), sin.view(t, -1), caches[0], caches[1], slots + 64, heads,
                              kv_heads)



def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (NaN != NaN for torch.equal)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_bf16_inputs_and_outputs_are_the_casts_they_replace(kernels) -> None:  # type: ignore[no-untyped-def]
    """Where the dense GEMMs run in bf16 the kernels read their bf16 outputs and write the next GEMM's
    bf16 input (model/llama.py `_bf16_io`): bit for bit what casting around the fp32 kernels gives."""
    g = torch.Generator().manual_seed(2)
    bf = torch.bfloat16
    for rows in (1, 5, 33):  # below and above a thread's share of rows
        x = torch.randn(rows, 576, generator=g) * 30
        x[-1, 0] = float("inf")  # a row that overflows: NaN and inf travel as the cast takes them
        w = torch.randn(576, generator=g)
        assert _same(kernels.rms_norm(x, w, 1e-5, out_bf16=True), kernels.rms_norm(x, w, 1e-5).to(bf))
        delta = (torch.randn(rows, 576, generator=g) * 5).to(bf)
        x1, x2 = x.clone(), x.clone()
        h1 = kernels.add_rms_norm(x1, delta, w, 1e-5, out_bf16=True)
        h2 = kernels.add_rms_norm(x2, delta.float(), w, 1e-5).to(bf)
        assert _same(x1, x2) and _same(h1, h2)
        gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(bf)
        gate_up[0, 0] = float("nan")
        assert _same(kernels.silu_mul(gate_up, out_bf16=True), kernels.silu_mul(gate_up.float()).to(bf))
        assert _same(kernels.silu_mul(gate_up), kernels.silu_mul(gate_up.float()))
    heads, kv_heads, d, t = 9, 3, 64, 7
    rope = RotaryTable(d, 2048, 10000.0, None, torch.float32)
    cos, sin = rope.lookup(torch.tensor([0, 1, 2, 100, 101, 2047, 5]))
    slots = torch.tensor([3, 4, 5, 40, 41, 63, 0])
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    # V is stored as given: halfway cases of the rounding (to even: down, then up), a NaN, infinities.
    qkv[0, -5:] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan"), float("inf"), -float("inf")])
    caches = [torch.zeros(4, 16, kv_heads, d, dtype=bf) for _ in range(4)]
    kernels.rope_write_kv(qkv, cos.view(t, -1), sin.view(t, -1), caches[0], caches[1], slots, heads, kv_heads)
    write_kv(caches[2], caches[3], caches[0].view(-1, kv_heads, d)[slots].float(),
             qkv[:, -kv_heads * d:].reshape(t, kv_heads, d), slots)
    assert _same(caches[1], caches[3]) and caches[1][0, 3, -1, -5:-3].tolist() == [1.0, 1.0 + 2**-6]
    # bf16 qkv rows (a dense GEMM's output) give what their fp32 copy gives.
    qkv16 = qkv.nan_to_num().to(bf)
    q1 = kernels.rope_write_kv(qkv16, cos.view(t, -1), sin.view(t, -1), caches[0], caches[1], slots, heads, kv_heads)
    q2 = kernels.rope_write_kv(qkv16.float(), cos.view(t, -1), sin.view(t, -1), caches[2], caches[3], slots, heads,
                               kv_heads)
    assert q1.dtype == torch.float32 and torch.equal(q1, q2)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.rms_norm(x.to(bf), w, 1e-5)  # the residual stream stays fp32
