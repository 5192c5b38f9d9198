"""Model sources for the model-version tests and `sluice bench version-switch`, written straight to
disk (no transformers: its import and GGUF conversion take most of a minute on the CI machine).

    tiny_llama      a random 1-layer Llama as a Hugging Face folder (config.json, safetensors, the
                    bundled model's tokenizer saved as tokenizer.json); two seeds give two versions
                    whose greedy outputs tell them apart
    unsupported     a folder whose config.json names an architecture no loader implements
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from engine_native.model.bundled import bundled_model_path
from engine_native.model.tokenizer_loader import load_tokenizer

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 32, 64, 2, 1


def tiny_llama(folder: Path, seed: int = 0) -> Path:
    tok: Any = load_tokenizer(bundled_model_path())  # the GGUF tokenizer: its backend, EOS and template
    assert tok is not None
    model_dir = folder / f"tiny-llama-{seed}"
    model_dir.mkdir(parents=True)
    tok.backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "eos_token": tok.eos_token, "chat_template": tok.chat_template,
    }))
    vocab = tok.vocab_size
    head_dim = HIDDEN // HEADS
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_ids,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    layer = "model.layers.0."
    save_file({
        # Unit-scale embeddings and lm head, its own per seed: greedy picks win by a wide margin (in
        # float32 the output does not change with the batch it runs in) and differ between seeds.
        "model.embed_tokens.weight": w(vocab, HIDDEN, scale=1.0),
        "lm_head.weight": w(vocab, HIDDEN, scale=1.0),
        "model.norm.weight": np.ones(HIDDEN, dtype=np.float32),
        layer + "input_layernorm.weight": np.ones(HIDDEN, dtype=np.float32),
        layer + "post_attention_layernorm.weight": np.ones(HIDDEN, dtype=np.float32),
        layer + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
        layer + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
        layer + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
        layer + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
        layer + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        layer + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        layer + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
    }, str(model_dir / "model.safetensors"))
    return model_dir


def unsupported(folder: Path) -> Path:
    """A real safetensors file under a config.json of an architecture we do not implement."""
    model_dir = folder / "gpt2-like"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_file({"wte.weight": np.zeros((4, 4), dtype=np.float32)}, str(model_dir / "model.safetensors"))
    return model_dir
