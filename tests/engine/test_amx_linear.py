"""The AMX path (kernels/amx_linear.cpp): Q4_1 blocks dequantized to the dense path's very bf16 weights,
so a step that takes it differs from the dense bf16 GEMM only in the order of additions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine_native.kernels import cpu_kernels
from engine_native.model.bundled import bundled_model_path
from engine_native.model.loader import load_model
from engine_native.model.quant import Q41Weight, amx_available, amx_linear, dequantize

sys.path.insert(0, str(Path(__file__).parent))
from test_model_support import prompts_then_a_decode

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX-BF16: the dense GEMM runs instead")


def _random_q4_1(n: int, k: int, seed: int) -> Q41Weight:
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()  # gguf keeps d and m as fp16
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.15).half().float()
    return Q41Weight(qs, torch.cat([d, m], dim=-1).contiguous())


@needs_amx
def test_the_kernel_dequantizes_to_exactly_the_dense_bf16_weights() -> None:
    """One-hot rows of x pick single weights out: each product is exact, so the output is the weight."""
    w = _random_q4_1(64, 96, seed=1)
    eye = torch.eye(96, dtype=torch.bfloat16)
    kernels = cpu_kernels()
    assert kernels is not None
    picked = kernels.amx_q4_1_linear(eye, w.qs, w.dm, False)  # [96, 64] fp32
    assert torch.equal(picked.T, dequantize(w).to(torch.bfloat16).float())


@needs_amx
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 37, 64, 100])
def test_the_kernel_matches_the_dense_product_for_any_number_of_rows(rows: int) -> None:
    w = _random_q4_1(96, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    kernels = cpu_kernels()
    assert kernels is not None
    out = kernels.amx_q4_1_linear(x, w.qs, w.dm, False)
    reference = x.double() @ dequantize(w).to(torch.bfloat16).double().T
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
    # The bf16 result is the fp32 one rounded to nearest even, as torch (and oneDNN's bf16 output) round.
    assert torch.equal(kernels.amx_q4_1_linear(x, w.qs, w.dm, True), out.to(torch.bfloat16))
    assert torch.equal(amx_linear(x.float(), w), out.to(torch.bfloat16))


@needs_amx
def test_bad_shapes_are_refused_not_computed() -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    w = _random_q4_1(48, 64, seed=2)  # 48 rows: not a multiple of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.amx_q4_1_linear(torch.zeros(4, 64, dtype=torch.bfloat16), w.qs, w.dm, True)
    w = _random_q4_1(64, 64, seed=2)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.amx_q4_1_linear(torch.zeros(4, 96, dtype=torch.bfloat16), w.qs, w.dm, True)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.amx_q4_1_linear(torch.zeros(4, 64), w.qs, w.dm, True)


@needs_amx
def test_a_decode_step_through_amx_gives_the_dense_steps_logits_and_prompts_stay_dense() -> None:
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    model = loaded.model

    def logits(amx_max_rows: int) -> list[torch.Tensor]:
        assert model.enable_quantized(8, amx_max_rows) == 4 * loaded.config.num_layers + 1
        assert bool(model.layers[0].amx) == (amx_max_rows > 0)
        return prompts_then_a_decode(model, loaded.config, torch.bfloat16)

    dense = logits(0)
    amx = logits(64)
    # A prompt step stays on oneDNN within amx_max_rows too: the same logits, the same K/V for the decode.
    assert torch.equal(dense[0], amx[0])
    torch.testing.assert_close(amx[1], dense[1], atol=0.1, rtol=0.02)
    assert torch.equal(amx[1].argmax(-1), dense[1].argmax(-1))


def test_amx_is_off_where_its_values_would_not_be_the_dense_ones() -> None:
    """fp32 dense weights (or no AMX here): the AMX path stays off, whatever amx_max_rows asks."""
    loaded = load_model(bundled_model_path(), dtype=torch.float32, progress=False)
    loaded.model.enable_quantized(8, 64)
    assert not loaded.model.layers[0].amx and loaded.model.layers[0].amx_max_rows == 0
    if not amx_available():
        kernels = cpu_kernels()
        assert kernels is not None
        with pytest.raises(RuntimeError, match="AMX-BF16 is not available"):
            kernels.amx_q4_1_linear(torch.zeros(1, 32, dtype=torch.bfloat16),
                                    torch.zeros(32, 1, 16, dtype=torch.uint8), torch.zeros(32, 1, 2), True)
