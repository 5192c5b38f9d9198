"""The panel kernels (kernels/quant_panel.cpp), which multiply steps of 9 to a few hundred rows by the
GGUF blocks where the dense path is fp32: exactly the dense weights' values, products equal to the
dense GEMM's up to the order of additions, and the engine's greedy answers unchanged by them."""

from __future__ import annotations

import pytest
import torch
from bundled_blocks import bundled_blocks

from engine_native.config import CacheConfig, EngineConfig
from engine_native.engine import LLMEngine
from engine_native.model.bundled import bundled_model_path
from engine_native.model.quant import (
    Q41Weight,
    Q80Weight,
    dequantize,
    panel_blocks,
    panel_fits,
    panel_linear,
)
from engine_native.sampling_params import SamplingParams

NAMES = ["blk.0.ffn_down.weight", "blk.2.attn_qkv", "token_embd.weight"]


@pytest.fixture(scope="module")
def bundled() -> dict[str, tuple[Q41Weight | Q80Weight, torch.Tensor]]:
    out = bundled_blocks(("blk.0.ffn_down.weight", "token_embd.weight", "blk.2.attn_k.weight"))
    # A qkv-shaped Q4_1 weight, 960 x 576: five copies of a 192-row k_proj.
    k_blocks, k_dense = out.pop("blk.2.attn_k.weight")
    assert isinstance(k_blocks, Q41Weight)
    out["blk.2.attn_qkv"] = (Q41Weight(torch.cat([k_blocks.qs] * 5), torch.cat([k_blocks.dm] * 5)),
                             torch.cat([k_dense] * 5))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_panel_holds_exactly_the_dense_weights(bundled, name: str) -> None:  # type: ignore[no-untyped-def]
    """x = rows of the identity: each product is one weight times 1 plus zeros, so the output is the
    panel's dequantized weight itself, bit for bit."""
    blocks, dense = bundled[name]
    panel = panel_blocks(blocks)
    k = dense.shape[1]
    for start in range(0, k, 200):
        eye = torch.eye(k)[start:start + 200]
        assert torch.equal(panel_linear(eye, panel), dense[:, start:start + 200].t())


@pytest.mark.parametrize("rows", [1, 9, 12, 13, 32, 64, 200])
@pytest.mark.parametrize("name", NAMES)
def test_the_product_equals_the_dense_one_up_to_summation_order(bundled, name: str, rows: int) -> None:  # type: ignore[no-untyped-def]
    blocks, dense = bundled[name]
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ dense.double().t()
    ours = panel_linear(x, panel_blocks(blocks)).double()
    # Each output sums its K <= 1536 products in order in fp32: a bound of K * eps * sum |x w|.
    bound = dense.shape[1] * 2.0**-24 * (x.double().abs() @ dense.double().abs().t())
    assert bool(((ours - exact).abs() <= bound).all())


def test_bias_bf16_inputs_and_what_fits() -> None:
    g = torch.Generator().manual_seed(0)
    w = Q41Weight(torch.randint(0, 256, (64, 4, 16), dtype=torch.uint8, generator=g), torch.randn(64, 4, 2, generator=g))
    x = torch.randn(20, 128, generator=g).bfloat16()
    bias = torch.randn(64, generator=g)
    y = panel_linear(x, panel_blocks(w), bias)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.float() @ dequantize(w).t() + bias, atol=1e-4, rtol=1e-5)
    assert not panel_fits(Q41Weight(w.qs[:48], w.dm[:48]))  # 48 rows: not whole 32-row tiles


def test_bad_layouts_are_refused_not_misread() -> None:
    w = panel_blocks(Q41Weight(torch.zeros(64, 4, 16, dtype=torch.uint8), torch.zeros(64, 4, 2)))
    with pytest.raises(RuntimeError, match="columns"):
        panel_linear(torch.zeros(3, 96), w)
    with pytest.raises(RuntimeError, match="dm must be"):
        panel_linear(torch.zeros(3, 128), type(w)(w.qs, w.scales[:, :2].contiguous(), q4_1=True))


def _engine(panel_max_rows: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model_path=bundled_model_path(), dtype="float32", quantized_max_rows=8,
                     panel_max_rows=panel_max_rows, cache=CacheConfig(num_blocks=256, enable_prefix_caching=False)),
        progress=False,
    )


def test_greedy_answers_of_a_batch_of_12_are_the_dense_paths() -> None:
    """12 sequences decode in steps of 12 rows (the panel kernels; their prompts' prefill too, in steps of
    up to 256 rows) or of the dense fp32 GEMM: the same weight values, so the same greedy answers."""
    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
                 "Write one sentence about the sea.", "Give me a word that rhymes with cat.",
                 "What colour is the sky on a clear day?", "Translate 'good morning' to Spanish.",
                 "How many legs does a spider have?", "Name a planet.", "What is water made of?",
                 "Say hello in French.", "What is the opposite of hot?"]
    panel, dense = _engine(EngineConfig.__dataclass_fields__["panel_max_rows"].default), _engine(0)
    assert panel.loaded.model.panel_max_rows > 12 and dense.loaded.model.panel_max_rows == 0
    tok = panel.tokenizer
    assert tok is not None
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in questions]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    got = panel.generate(prompts, greedy)
    assert got == dense.generate(prompts, greedy)
    assert "Paris" in tok.decode(got[0])
