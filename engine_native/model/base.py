"""Contracts that model loaders, architectures and tokenizers plug into.

The runner sees only `CausalLM` and `Tokenizer` (model/tokenizer.py); `load_model` in
`engine_native.model.loader` turns a path (a .gguf file or a Hugging Face
folder) into a `LoadedModel`. The load errors are in model/errors.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine_native.config import ModelConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.attention_backends import AttentionBackend
from engine_native.model.quant import NO_ROUNDING, ActivationRounding
from engine_native.model.tokenizer import Tokenizer


class CausalLM(Protocol):
    config: ModelConfig
    # How its layers attend (model/attention_backends.py); None: the model's own CPU path.
    attention_backend: AttentionBackend | None
    # What the own CPU path's prefill attention computes in (EngineConfig.prefill_attention_dtype).
    prefill_attention_dtype: torch.dtype
    # Whether its fp32 prefill attention may take the AMX split-bf16 kernel (EngineConfig, "float32").
    prefill_attention_kernel_on: bool

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Write the new tokens' K/V into `kv_cache`, return float32 logits
        [len(batch.logits_indices), vocab_size]."""
        ...

    def enable_quantized(self, max_rows: int, amx_max_rows: int = 0, panel_max_rows: int = 0,
                         rounding: ActivationRounding = NO_ROUNDING) -> int:
        """Multiply by the weights' quantized blocks (when the loader kept them) in steps of at most
        `max_rows` tokens, through AMX in steps of at most `amx_max_rows` where the CPU has it, and
        through the panel kernels in steps of at most `panel_max_rows` where the dense path is fp32;
        the blocks' steps round their activations to integer blocks of 32 as `rounding` says (not the fp32
        products). Returns how many weight matrices will (0 where unsupported)."""
        ...

    def pack_dense(self, batch_hint: int = 32, bf16_panel_max_rows: int = 0) -> int:
        """Lay the dense weights out for the host's GEMM library once, where that is faster (bf16: the same
        results; fp32: oneDNN's sums in place of MKL's, in another order), and for the bf16 panel kernel
        (pure-decode steps of up to `bf16_panel_max_rows` sequences) where the CPU has it; returns how many
        matrices were packed (0 where it does not apply)."""
        ...

    def place_on(self, device: torch.device) -> None:
        """Move every weight and table the forward reads to `device`."""
        ...


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None  # None only for weight-only folders (tests feed token ids)
    config: ModelConfig
    dtype: torch.dtype
    source: str  # the path it came from
