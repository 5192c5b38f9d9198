"""Dense weights pre-packed for oneDNN (model/llama.py pack_dense) change no result, only speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine_native.model.bundled import bundled_model_path
from engine_native.model.llama import can_pack
from engine_native.model.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
from test_model_support import PagedSequences


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="packing applies to bf16 on a CPU with native bf16")
def test_packed_weights_give_bit_identical_logits_and_free_the_plain_copies() -> None:
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    model = loaded.model
    model.enable_quantized(0)  # every step through the dense weights

    def logits() -> list[torch.Tensor]:
        seqs = PagedSequences(loaded.config, num_blocks=64, block_size=16, dtype=torch.bfloat16, seed=3)
        prompts = [list(range(100, 137)), list(range(2000, 2021)), [5, 6, 7]]
        prefill = model.forward(seqs.step([(i, p) for i, p in enumerate(prompts)]), seqs.cache)
        decode = model.forward(seqs.step([(i, [300 + i]) for i in range(len(prompts))]), seqs.cache)
        return [prefill, decode]

    plain = logits()
    assert model.pack_dense() == 4 * loaded.config.num_layers + 1
    assert model.pack_dense() == 0  # once
    layer = model.layers[0]
    assert layer.gate_up_weight.numel() == 0 and set(layer.packed) == {
        "qkv_weight", "o_weight", "gate_up_weight", "down_weight"}
    packed = logits()
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)


def test_fp32_weights_are_packed_for_onednn_with_the_same_answers() -> None:
    """fp32 weights are packed on every CPU (oneDNN's GEMM in place of MKL's sgemm): the same products
    summed in another order, so logits agree to fp32 rounding and every row picks the same token."""
    assert can_pack(torch.float32)
    loaded = load_model(bundled_model_path(), dtype=torch.float32, progress=False)
    model = loaded.model
    model.enable_quantized(0)  # every step through the dense weights

    def logits() -> list[torch.Tensor]:
        seqs = PagedSequences(loaded.config, num_blocks=64, block_size=16, dtype=torch.float32, seed=3)
        prompts = [list(range(100, 137)), list(range(2000, 2021)), [5, 6, 7]]
        prefill = model.forward(seqs.step([(i, p) for i, p in enumerate(prompts)]), seqs.cache)
        decode = model.forward(seqs.step([(i, [300 + i]) for i in range(len(prompts))]), seqs.cache)
        return [prefill, decode]

    plain = logits()
    assert model.pack_dense() == 4 * loaded.config.num_layers + 1
    layer = model.layers[0]
    assert layer.down_weight.numel() == 0 and set(layer.packed) == {
        "qkv_weight", "o_weight", "gate_up_weight", "down_weight"}
    packed = logits()
    for a, b in zip(plain, packed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
