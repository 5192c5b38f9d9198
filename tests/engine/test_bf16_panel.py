"""The bf16 panel path (kernels/bf16_panel.cpp): the dense bf16 weights laid out for AVX-512 BF16 dot
products, so a pure-decode step that takes it differs from oneDNN's bf16 GEMM only in the order of
additions, and a row's result does not depend on how many rows share its step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine_native.config import CacheConfig, EngineConfig
from engine_native.engine import LLMEngine
from engine_native.kernels import cpu_kernels
from engine_native.model.bf16_panel import (
    MAX_MEMORY_FRACTION,
    bf16_panel_available,
    bf16_panel_fits,
    bf16_panel_linear,
    panels_fit_in_memory,
    to_bf16_panel,
)
from engine_native.model.bundled import bundled_model_path
from engine_native.model.llama import can_pack
from engine_native.model.loader import load_model
from engine_native.model.quant import amx_available
from engine_native.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_model_support import prompts_then_a_decode

# Where the CPU has AMX its own kernels take the decode steps and the engine keeps no panels.
panels_on_here = bf16_panel_available() and not amx_available()


def _kernel_refused_here() -> bool:
    """Where the kernels are built without AVX-512 BF16, assert that the kernel refuses to compute (oneDNN
    takes every step there) and say so; elsewhere False, and the caller checks what it computes."""
    if bf16_panel_available():
        return False
    kernels = cpu_kernels()
    assert kernels is not None
    with pytest.raises(RuntimeError, match="AVX-512 BF16 is not available"):
        kernels.bf16_panel_linear(torch.zeros(1, 96, dtype=torch.bfloat16), to_bf16_panel(_weight(64, 96, 0)).data,
                                  64, None, True)
    return True


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def test_the_panel_holds_exactly_the_dense_weights() -> None:
    """One-hot rows of x pick single weights out: each product is exact, so the output is the weight."""
    if _kernel_refused_here():
        return
    w = _weight(64, 96, seed=1)
    picked = bf16_panel_linear(torch.eye(96, dtype=torch.bfloat16), to_bf16_panel(w))  # [96, 64] fp32
    assert torch.equal(picked.T, w.float())


@pytest.mark.parametrize(("rows", "features"), [(1, 96), (7, 96), (8, 96), (9, 100), (32, 96), (37, 40), (64, 144),
                                                (100, 17)])
def test_the_product_equals_the_dense_one_up_to_summation_order(rows: int, features: int) -> None:
    if _kernel_refused_here():
        return
    w = _weight(features, 576, seed=rows)
    bias = torch.randn(features, generator=torch.Generator().manual_seed(7))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    panel = to_bf16_panel(w)
    out = bf16_panel_linear(x, panel, bias)
    reference = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
    # The bf16 result is the fp32 one rounded to nearest even, as torch (and oneDNN's bf16 output) round.
    assert torch.equal(bf16_panel_linear(x, panel, bias, out_bf16=True), out.to(torch.bfloat16))
    # A row's result is the same bits whichever pass of the kernel it falls in.
    for r in (0, rows - 1):
        assert torch.equal(bf16_panel_linear(x[r : r + 1], panel, bias), out[r : r + 1])
    # fp32 input is rounded to bf16 first, as the dense GEMM's input is.
    assert torch.equal(bf16_panel_linear(x.float(), panel, bias), out)


def test_what_fits_and_bad_layouts_are_refused_not_misread() -> None:
    assert bf16_panel_fits(_weight(64, 96, 0)) and bf16_panel_fits(_weight(17, 96, 0))
    assert not bf16_panel_fits(_weight(64, 95, 0))  # K odd: the kernel reads pairs
    assert not bf16_panel_fits(_weight(64, 96, 0).float())
    panel = to_bf16_panel(_weight(64, 96, 0))
    assert panel.out_features == 64 and tuple(panel.data.shape) == (2, 48, 48, 2)  # 64 rows padded to 96
    assert not bool(panel.data[1, :, 16:].any())  # the padding is zeros
    kernels = cpu_kernels()
    assert kernels is not None
    x = torch.zeros(4, 96, dtype=torch.bfloat16)
    if _kernel_refused_here():
        return
    with pytest.raises(RuntimeError, match="columns"):
        kernels.bf16_panel_linear(torch.zeros(4, 64, dtype=torch.bfloat16), panel.data, 64, None, True)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_panel_linear(x.float(), panel.data, 64, None, True)
    with pytest.raises(RuntimeError, match="panel"):
        kernels.bf16_panel_linear(x, panel.data.float(), 64, None, True)
    with pytest.raises(RuntimeError, match="rounded up"):
        kernels.bf16_panel_linear(x, panel.data, 97, None, True)  # more columns than the panel holds
    with pytest.raises(RuntimeError, match="rounded up"):
        kernels.bf16_panel_linear(x, panel.data, 48, None, True)  # fewer than its last panel starts at
    with pytest.raises(RuntimeError, match="bias"):
        kernels.bf16_panel_linear(x, panel.data, 64, torch.zeros(63), True)


def test_a_decode_step_through_the_panels_gives_onednns_logits_and_prompts_stay_on_onednn() -> None:
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    model = loaded.model
    model.enable_quantized(8)
    # bf16 weights are packed only where the CPU computes bf16 natively (can_pack); elsewhere F.linear
    # takes every dense step, with or without the panels' request.
    packed = 4 * loaded.config.num_layers + 1 if can_pack(torch.bfloat16) else 0
    assert model.pack_dense(bf16_panel_max_rows=64) == packed

    def logits(panel_rows: int) -> list[torch.Tensor]:
        model.bf16_panel_max_rows = panel_rows
        for layer in model.layers:
            layer.bf16_panel_max_rows = panel_rows
        return prompts_then_a_decode(model, loaded.config, torch.bfloat16)

    onednn = logits(0)
    panel = logits(64)
    if not panels_on_here:  # no AVX-512 BF16, or AMX: no panels were made, the dense GEMM took both steps both times
        assert not model.layers[0].bf16_panels and model.lm_head_bf16_panel is None
        assert torch.equal(onednn[0], panel[0]) and torch.equal(onednn[1], panel[1])
        return
    assert len(model.layers[0].bf16_panels) == 4 and model.lm_head_bf16_panel is not None
    # A prompt step stays on oneDNN within bf16_panel_max_rows too: the same logits, the same K/V for the decode.
    assert torch.equal(onednn[0], panel[0])
    assert not torch.equal(onednn[1], panel[1])  # the decode did take the other kernel
    # Each GEMM's bf16 outputs are oneDNN's but for rare last-bit flips (the test below); SmolLM2 carries
    # ~25,000 in a few residual channels, where one bf16 step is 128, so a flip there moves the logits
    # by a few tenths after 30 layers. The panel's logits are its fp32 sums, oneDNN's come back rounded to
    # bf16 (a step of 0.125 at 16-32, where two tokens can tie exactly): each row's pick is oneDNN's best
    # or within that drift of it.
    torch.testing.assert_close(panel[1], onednn[1], atol=0.5, rtol=0.02)
    best = onednn[1].max(-1).values
    picked = onednn[1].gather(-1, panel[1].argmax(-1, keepdim=True)).squeeze(-1)
    assert bool((picked >= best - 0.5).all())
    assert int((panel[1].argmax(-1) == onednn[1].argmax(-1)).sum()) >= 9


def test_the_models_own_products_are_onednns_but_for_rare_last_bit_flips() -> None:
    if _kernel_refused_here():
        return
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    layer = loaded.model.layers[3]
    for seed, name in enumerate(("qkv_weight", "o_weight", "gate_up_weight", "down_weight")):
        w = getattr(layer, name).data
        x = (torch.randn(12, w.shape[1], generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)
        onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 32), None,
                                                    "none", [], "")
        panel = bf16_panel_linear(x, to_bf16_panel(w), out_bf16=True)
        flipped = onednn != panel
        assert float(flipped.float().mean()) < 1e-3, name
        # A flip is one step of bf16 at that value: the two fp32 sums fell either side of a rounding midpoint.
        step = 2.0 ** (torch.frexp(onednn.float()[flipped])[1] - 8).double()
        if amx_available():
            # oneDNN multiplies through AMX here (whose tile sums round otherwise than fp32 FMAs): where a sum nearly
            # cancels, the two differ by the fp32 rounding of the terms, not of the result (seen: 3.6e-7 at a value of
            # 3.8e-6, against outputs of ~4). The panels never run on such a CPU.
            step = torch.maximum(step, torch.tensor(1e-6 * float(onednn.float().abs().max())).double())
        assert bool(((onednn.double() - panel.double())[flipped].abs() <= step).all()), name


def test_the_panels_are_a_second_copy_only_where_memory_allows_it() -> None:
    """A big model keeps oneDNN alone rather than run out of memory: the panels (padded to whole panels)
    must fit in MAX_MEMORY_FRACTION of what is available."""
    weights = [_weight(64, 96, 0), _weight(100, 96, 1)]  # padded to 96 and 144 rows: 240 x 96 x 2 bytes
    needed = 240 * 96 * 2
    assert panels_fit_in_memory(weights, int(needed / MAX_MEMORY_FRACTION))
    assert not panels_fit_in_memory(weights, int(needed / MAX_MEMORY_FRACTION) - 1)
    # The bundled model's panels (~270 MB) against this host's memory.
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    model = loaded.model
    dense = [getattr(layer, n).data for layer in model.layers
             for n in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")] + [model.lm_head.data]
    assert panels_fit_in_memory(dense, 2 * 1024**3)
    assert not panels_fit_in_memory(dense, 512 * 1024**2)


def test_the_panels_are_off_where_the_dense_weights_are_not_bf16_or_amx_takes_the_steps() -> None:
    loaded = load_model(bundled_model_path(), dtype=torch.float32, progress=False)
    loaded.model.pack_dense(bf16_panel_max_rows=64)
    assert loaded.model.bf16_panel_max_rows == 0 and not loaded.model.layers[0].bf16_panels
    engine = LLMEngine(EngineConfig(model_path=bundled_model_path(), cache=CacheConfig(num_blocks=64)),
                       progress=False)
    assert (engine.loaded.model.bf16_panel_max_rows > 0) == (panels_on_here and engine.loaded.dtype == torch.bfloat16)


def test_the_blocks_take_decode_steps_of_up_to_2_sequences_where_the_panels_are_made_else_8() -> None:
    """From 3 sequences the panels' bf16 products are faster than the blocks' fp32 ones (docs/engine.md):
    left unset, quantized_max_rows gives way to them where they are made; set, it is kept."""
    auto = LLMEngine(EngineConfig(model_path=bundled_model_path(), cache=CacheConfig(num_blocks=64)), progress=False)
    model = auto.loaded.model
    assert model.quantized_max_rows == (2 if panels_on_here and auto.loaded.dtype == torch.bfloat16 else 8)
    assert (model.bf16_panel_max_rows > 0) == (model.quantized_max_rows == 2)
    explicit = LLMEngine(EngineConfig(model_path=bundled_model_path(), quantized_max_rows=8,
                                      cache=CacheConfig(num_blocks=64)), progress=False)
    assert explicit.loaded.model.quantized_max_rows == 8
    assert explicit.loaded.model.bf16_panel_max_rows == model.bf16_panel_max_rows  # steps of 9 and more
    no_panels = LLMEngine(EngineConfig(model_path=bundled_model_path(), bf16_panel_max_rows=0,
                                       cache=CacheConfig(num_blocks=64)), progress=False)
    assert no_panels.loaded.model.quantized_max_rows == 8 and no_panels.loaded.model.bf16_panel_max_rows == 0


def test_greedy_answers_of_a_batch_of_12_are_as_faithful_as_onednns() -> None:
    """12 sequences decode in steps of 12 rows through the panels or through oneDNN. The two differ in the
    order of additions and in the logits (fp32 sums against oneDNN's bf16-rounded ones, where two tokens can
    tie exactly), so a near tie can go either way: Hugging Face in fp32, teacher-forced on each engine's
    greedy output, must agree with the panels' tokens at least as often as with oneDNN's (minus 0.01), and
    find none more than 1 nat below its best (the bar of test_numerics.py). Where no panels are made (no
    AVX-512 BF16, or AMX) both engines are oneDNN's: the same answers, held to the same bar."""
    from hf_bundled import hf_bundled
    from test_numerics import agreement

    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
                 "Write one sentence about the sea.", "Give me a word that rhymes with cat.",
                 "What colour is the sky on a clear day?", "Translate 'good morning' to Spanish.",
                 "How many legs does a spider have?", "Name a planet.", "What is water made of?",
                 "Say hello in French.", "What is the opposite of hot?"]

    def engine(panel_rows: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=bundled_model_path(), bf16_panel_max_rows=panel_rows,
                                      cache=CacheConfig(num_blocks=512)), progress=False)

    panel, onednn = engine(256), engine(0)
    assert panel.loaded.model.bf16_panel_max_rows == (256 if panels_on_here else 0)
    assert onednn.loaded.model.bf16_panel_max_rows == 0
    tok = panel.tokenizer
    assert tok is not None
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in questions]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    got = panel.generate(prompts, greedy)
    # No check of one answer's words: a near tie goes either way whatever the kernel (on an AMX host question 0's
    # first token is "The" 0.06 nat ahead of "L" alone, and the two tie exactly in the batch's bf16-rounded
    # logits, where the first index, "L", wins). Hugging Face's agreement below holds the answers' sense.
    hf_fp32 = hf_bundled(torch.float32)
    rate, worst_gap = agreement(hf_fp32, prompts, got)
    onednn_got = onednn.generate(prompts, greedy)
    if not panels_on_here:
        assert got == onednn_got
    onednn_rate, onednn_gap = agreement(hf_fp32, prompts, onednn_got)
    print(f"agreement with HF fp32: panels {rate:.3f} (worst gap {worst_gap:.3f} nat), "
          f"oneDNN {onednn_rate:.3f} ({onednn_gap:.3f})")
    assert rate >= onednn_rate - 0.01
    assert rate >= 0.9
    assert worst_gap <= 1.0
