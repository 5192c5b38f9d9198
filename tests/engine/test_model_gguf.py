"""GGUF loading on tiny files we write ourselves with gguf.GGUFWriter, every tensor type we
claim, q/k permuted the way llama.cpp's converter does it; plus load errors."""

from __future__ import annotations

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_model_support import PagedSequences
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from engine_native.model.errors import ModelLoadError
from engine_native.model.gguf_loader import permute_qk, unpermute_qk
from engine_native.model.loader import load_model

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_COMMON: dict = dict(  # noqa: C408
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def _roundtrip(array: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to store, what a correct reader must get back)."""
    if qtype == Q.F32:
        return array, array
    if qtype == Q.F16:
        stored = array.astype(np.float16)
        return stored, stored.astype(np.float32)
    raw = gguf.quants.quantize(array, qtype)
    return raw, gguf.quants.dequantize(raw, qtype)


def _write_gguf(path: Path, hf: torch.nn.Module, arch: str, qtype: Q, tied: bool) -> dict[str, torch.Tensor]:
    """Write `hf` as llama.cpp would; returns the HF state dict as the reader should see it."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute_qk(array, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute_qk(array, cfg.num_key_value_heads)
        stored, readback = _roundtrip(array, qtype if array.ndim == 2 else Q.F32)
        raw_dtype = qtype if array.ndim == 2 and qtype not in (Q.F32, Q.F16) else None
        w.add_tensor(_gguf_name(name), stored, raw_dtype=raw_dtype)
        if arch == "llama" and name.endswith("q_proj.weight"):
            readback = unpermute_qk(readback, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            readback = unpermute_qk(readback, cfg.num_key_value_heads)
        expected[name] = torch.from_numpy(np.ascontiguousarray(readback, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_permutation_roundtrip() -> None:
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    assert not np.array_equal(permute_qk(w, 3), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


# Tolerance of the raw weights versus the originals, per type (absolute, weights ~N(0, 0.02)).
WEIGHT_ATOL = {Q.F32: 0.0, Q.F16: 1e-4, Q.BF16: 1e-3, Q.Q8_0: 2e-3, Q.Q4_0: 2e-2, Q.Q4_1: 2e-2}


@pytest.mark.parametrize("qtype", list(WEIGHT_ATOL), ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_logits_match_hf_with_the_same_weights(tmp_path: Path, arch: str, qtype: Q) -> None:
    torch.manual_seed(0)
    tied = qtype == Q.Q8_0  # one tied variant: no output.weight in the file
    if arch == "llama":
        hf = HFLlama(LlamaConfig(**_COMMON, tie_word_embeddings=tied)).eval()
    else:
        hf = HFQwen2(Qwen2Config(**_COMMON, tie_word_embeddings=tied)).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    expected = _write_gguf(tmp_path / "tiny.gguf", hf, arch, qtype, tied)
    for name, t in expected.items():  # the quantization error itself stays within bounds
        assert (t - original[name]).abs().max() <= WEIGHT_ATOL[qtype] + 1e-7, name
    ours = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32, progress=False)
    assert ours.config.architecture == arch and ours.config.tie_word_embeddings == tied
    assert ours.tokenizer is None
    # Reference: HF with exactly the dequantized weights a correct reader produces.
    hf.load_state_dict(expected, strict=False)
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    seqs = PagedSequences(ours.config, num_blocks=8, block_size=4, dtype=torch.float32)
    logits = torch.cat(
        [
            ours.model.forward(seqs.step([(0, ids[:9])]), seqs.cache),
            ours.model.forward(seqs.step([(0, ids[9:])]), seqs.cache),
        ]
    )
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_q8_0_dequantize_matches_a_numpy_reference() -> None:
    # Q8_0 block: fp16 scale d then 32 int8 q; value = d * q.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, Q.Q8_0)
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    ref = (d * q).reshape(4, 64)
    np.testing.assert_array_equal(gguf.quants.dequantize(raw, Q.Q8_0), ref)
    assert np.abs(ref - x).max() < 0.05


def test_missing_path_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"))


def test_folder_without_config_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="no config.json.*weights.bin"):
        load_model(str(tmp_path))


def test_unsupported_hf_architecture_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_unsupported_gguf_architecture_is_a_load_error(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="falcon"):
        load_model(str(tmp_path / "m.gguf"))


def test_not_a_gguf_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model(str(tmp_path / "junk.gguf"))
