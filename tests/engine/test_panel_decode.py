"""The layer decoder (kernels/panel_decode.cpp): a pure-decode step's layers in one C++ call where one kernel takes
all its GEMMs, the bf16 panels (AVX-512 BF16 without AMX) or AMX's. It runs the layer-by-layer path's kernels in the
same order with the same roundings, so every logit must be that path's, bit for bit."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from engine_native.config import CacheConfig, EngineConfig
from engine_native.engine import LLMEngine
from engine_native.kernels import cpu_kernels
from engine_native.model.bf16_panel import bf16_panel_available
from engine_native.model.bundled import bundled_model_path
from engine_native.model.llama import LlamaForCausalLM
from engine_native.model.loader import load_model
from engine_native.model.quant import amx_available
from engine_native.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_model_support import PagedSequences, bundled_as_the_engine_lays_it_out, prompts_then_a_decode

# Where the CPU has AMX its Q4_1 kernel takes the decode steps and the engine keeps no panels.
panels_on_here = bf16_panel_available() and not amx_available()
decoder_on_here = panels_on_here or amx_available()


def _layered_then_in_one_call(
    model: LlamaForCausalLM, steps: Callable[[], list[torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logits of the same steps (`steps()` runs them on a fresh cache) layer by layer, then with the decoder."""
    model.layer_decoder_on = False
    layered = steps()
    assert model._layer_decoder is None
    model.layer_decoder_on = True
    return layered, steps()


def test_the_bundled_models_decode_step_in_one_call_is_the_layer_paths_bit_for_bit() -> None:
    loaded = bundled_as_the_engine_lays_it_out()
    model = loaded.model
    assert isinstance(model, LlamaForCausalLM)
    layered, in_one_call = _layered_then_in_one_call(
        model, lambda: prompts_then_a_decode(model, loaded.config, torch.bfloat16))
    # Where neither kernel runs (no AVX-512 BF16) the layers take the step both times.
    assert (model._layer_decoder is not None) == decoder_on_here
    assert torch.equal(layered[0], in_one_call[0])  # the prompts: layer by layer both times
    assert torch.equal(layered[1], in_one_call[1])  # the 12-row decode


def test_a_model_with_a_qkv_bias_and_decodes_at_many_contexts_is_the_layer_paths_bit_for_bit(tmp_path: Path) -> None:
    """A tiny random Qwen2 (q/k/v biases) in bf16: 9 sequences of 3-43 tokens, then 6 decode steps, each
    in one call and layer by layer: the same logits every step, the cache the decoder wrote read back by it.
    (With AMX the qkv with its bias stays dense, so the layers take these steps both times.)"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16, progress=False)
    model = loaded.model
    assert isinstance(model, LlamaForCausalLM)
    model.pack_dense(bf16_panel_max_rows=16)
    assert (model.layers[0].qkv_bias_fp32 is not None) == panels_on_here

    def steps() -> list[torch.Tensor]:
        seqs = PagedSequences(loaded.config, num_blocks=64, block_size=16, dtype=torch.bfloat16, seed=5)
        prompts = [[(11 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(9)]
        out = [model.forward(seqs.step(list(enumerate(prompts)), last_only=True), seqs.cache)]
        for t in range(6):
            out.append(model.forward(seqs.step([(i, [(7 * i + t) % 256]) for i in range(9)]), seqs.cache))
        return out

    layered, in_one_call = _layered_then_in_one_call(model, steps)
    assert (model._layer_decoder is not None) == panels_on_here
    for a, b in zip(layered, in_one_call, strict=True):
        assert torch.equal(a, b)


def test_an_engines_greedy_answers_are_the_same_with_and_without_the_decoder() -> None:
    """Batches shrink from 10 sequences to 1 as their answers end: the steps of 3-10 take the decoder on the
    bf16 panels (those of 1-2 the blocks), with AMX those of 9-10 (those of 1-8 the blocks), both times."""
    engine = LLMEngine(EngineConfig(model_path=bundled_model_path(), cache=CacheConfig(num_blocks=512)), progress=False)
    model = engine.loaded.model
    assert isinstance(model, LlamaForCausalLM)
    tok = engine.tokenizer
    assert tok is not None
    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
                 "Write one sentence about the sea.", "Give me a word that rhymes with cat.", "Name a planet.",
                 "How many legs does a spider have?", "What is water made of?", "Say hello in French.",
                 "What is the opposite of hot?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in questions]

    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]

    def answers() -> list[list[int]]:
        return engine.generate(prompts, params)

    model.layer_decoder_on = False
    layered = answers()
    model.layer_decoder_on = True
    assert answers() == layered
    assert (model._layer_decoder is not None) == (decoder_on_here and engine.loaded.dtype == torch.bfloat16)


def test_bad_arguments_are_refused_not_misread() -> None:
    kernels = cpu_kernels()
    assert kernels is not None  # built by make setup on every AVX2 host, CI's included
    hidden, heads, kv_heads, d, inter = 64, 4, 2, 16, 96

    def panel(n: int, k: int) -> torch.Tensor:  # an [n, k] weight's panels, all zeros
        return torch.zeros(-(-n // 48), k // 2, 48, 2, dtype=torch.bfloat16)

    panels = [panel((heads + 2 * kv_heads) * d, hidden), panel(hidden, heads * d), panel(2 * inter, hidden),
              panel(hidden, inter)]
    norms = [torch.ones(hidden), torch.ones(hidden)]
    cache = [torch.zeros(8, 16, kv_heads, d, dtype=torch.bfloat16)]
    rope = torch.zeros(32, d)
    if not bf16_panel_available():
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, False, panels, [], norms, cache, cache, rope, rope)
        return
    with pytest.raises(RuntimeError, match="4 panels"):
        kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, False, panels[:3], [], norms, cache, cache, rope, rope)
    with pytest.raises(RuntimeError, match="panel 1 of layer 0"):
        kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, False, [panels[0], panels[0], *panels[2:]], [],
                             norms, cache, cache, rope, rope)
    decoder = kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, False, panels, [], norms, cache, cache, rope, rope)
    x = torch.zeros(2, hidden)
    one = torch.ones(2, dtype=torch.int64)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="slot out of the KV pool"):
        decoder.forward(x, one, torch.tensor([0, 8 * 16]), tables, one)
    with pytest.raises(RuntimeError, match="position beyond"):
        decoder.forward(x, torch.tensor([0, 32]), one, tables, one)
    with pytest.raises(RuntimeError, match="context length"):
        decoder.forward(x, one, one, tables, torch.tensor([1, 17]))
    with pytest.raises(RuntimeError, match="block id"):
        decoder.forward(x, one, one, torch.tensor([[0], [8]]), one)
    assert torch.equal(decoder.forward(x, one, one, tables, one), torch.zeros(2, hidden))  # zero weights add nothing


def test_bad_amx_blocks_are_refused_and_zero_blocks_add_nothing() -> None:
    """Where the CPU (or the build) has no AMX-BF16 the AMX form is refused outright, never run."""
    kernels = cpu_kernels()
    assert kernels is not None
    hidden, heads, kv_heads, d, inter = 64, 4, 2, 16, 96

    def blocks(n: int, k: int) -> list[torch.Tensor]:  # an [n, k] weight's Q4_1 blocks (qs, dm), all zeros
        return [torch.zeros(n, k // 32, 16, dtype=torch.uint8), torch.zeros(n, k // 32, 2)]

    weights = [*blocks((heads + 2 * kv_heads) * d, hidden), *blocks(hidden, heads * d), *blocks(2 * inter, hidden),
               *blocks(hidden, inter)]
    norms = [torch.ones(hidden), torch.ones(hidden)]
    cache = [torch.zeros(8, 16, kv_heads, d, dtype=torch.bfloat16)]
    rope = torch.zeros(32, d)
    if not amx_available():
        with pytest.raises(RuntimeError, match="AMX-BF16 is not available|AVX-512 BF16"):
            kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, True, weights, [], norms, cache, cache, rope,
                                 rope)
        return
    with pytest.raises(RuntimeError, match="4 matrices' blocks"):
        kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, True, weights[:6], [], norms, cache, cache, rope,
                             rope)
    with pytest.raises(RuntimeError, match="blocks 1 of layer 0"):
        kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, True, [*weights[:2], *weights[:2], *weights[4:]],
                             [], norms, cache, cache, rope, rope)
    with pytest.raises(RuntimeError, match="no qkv bias"):
        kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, True, weights, [torch.zeros(128)], norms, cache,
                             cache, rope, rope)
    decoder = kernels.DecodeLayers(hidden, heads, kv_heads, d, inter, 1e-5, True, weights, [], norms, cache, cache,
                                   rope, rope)
    one = torch.ones(2, dtype=torch.int64)
    assert torch.equal(decoder.forward(torch.zeros(2, hidden), one, one, torch.zeros(2, 1, dtype=torch.int64), one),
                       torch.zeros(2, hidden))
