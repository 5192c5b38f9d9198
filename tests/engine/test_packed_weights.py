"""Dense weights pre-packed for oneDNN (model/llama.py pack_dense): bf16 ones change no result, only speed; fp32
ones (oneDNN's sgemm in place of MKL's) change logits by fp32 rounding only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine_native.model.bundled import bundled_model_path
from engine_native.model.llama import can_pack
from engine_native.model.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
from test_model_support import prompts_then_a_decode


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="packing applies to bf16 on a CPU with native bf16")
def test_packed_weights_give_bit_identical_logits_and_free_the_plain_copies() -> None:
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    model = loaded.model
    model.enable_quantized(0)  # every step through the dense weights

    plain = prompts_then_a_decode(model, loaded.config, torch.bfloat16)
    assert model.pack_dense() == 4 * loaded.config.num_layers + 1
    assert model.pack_dense() == 0  # once
    layer = model.layers[0]
    assert layer.gate_up_weight.numel() == 0 and set(layer.packed) == {
        "qkv_weight", "o_weight", "gate_up_weight", "down_weight"}
    packed = prompts_then_a_decode(model, loaded.config, torch.bfloat16)
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)


def test_fp32_weights_are_packed_for_onednn_with_the_same_answers() -> None:
    """fp32 weights are packed on every CPU (oneDNN's GEMM in place of MKL's sgemm): the same products
    summed in another order, so logits agree to fp32 rounding and every row whose best token leads by more
    than that picks the same one."""
    assert can_pack(torch.float32)
    loaded = load_model(bundled_model_path(), dtype=torch.float32, progress=False)
    model = loaded.model
    model.enable_quantized(0)  # every step through the dense weights

    plain = prompts_then_a_decode(model, loaded.config, torch.float32)
    assert model.pack_dense() == 4 * loaded.config.num_layers + 1
    layer = model.layers[0]
    assert layer.down_weight.numel() == 0 and set(layer.packed) == {
        "qkv_weight", "o_weight", "gate_up_weight", "down_weight"}
    packed = prompts_then_a_decode(model, loaded.config, torch.float32)
    for a, b in zip(plain, packed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-3)  # 30 layers of fp32 sums in another order
        best_two = a.topk(2, dim=-1).values
        clear = best_two[:, 0] - best_two[:, 1] > 5e-2
        assert clear.sum() > len(clear) // 2
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
