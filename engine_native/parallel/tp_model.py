"""One tensor-parallel rank's slice of a Llama-family model.

Each layer is the single-process `DecoderLayer` built on the rank's local config (its heads, its
MLP columns: `sharding.ShardPlan`), so q/k/v and gate/up are column-parallel for free. The output
and down projections are row-parallel: each rank's product is a partial sum of the full one, and
an all-reduce adds them before the residual:

    x ─ norm ─ qkv(local heads) ─ attention(local KV pool) ─ o(local cols) ─ all-reduce ─ + x
      ─ norm ─ gate/up(local cols) ─ silu·mul ─ down(local rows) ─ all-reduce ─ + x

two all-reduces of [T, hidden] fp32 per layer. The embedding is replicated (a gather costs
nothing, a vocab-parallel one would need a third all-reduce); the LM head runs on rank 0 only,
which alone samples. This path is dense: the GGUF-block (quantized) kernels and the fused decoder
are single-process only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine_native.config import ModelConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.attention import AttentionPlan
from engine_native.model.llama import DecoderLayer
from engine_native.model.quant import kernels_available
from engine_native.model.rope import RotaryTable
from engine_native.parallel.comm import CollectiveClock

_ROW_PARALLEL = frozenset({"o_weight", "down_weight"})


class ParallelDecoderLayer(DecoderLayer):
    """`DecoderLayer` whose row-parallel products are summed across the group before use."""

    clock: CollectiveClock

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = super()._linear(x, name, bias)
        if name in _ROW_PARALLEL:
            self.clock.all_reduce(out)
        return out


class TensorParallelLlama(nn.Module):
    """Implements `CausalLM` for one rank. `forward` returns logits on rank 0, an empty tensor elsewhere."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        rank: int,
        clock: CollectiveClock,
    ) -> None:
        super().__init__()
        self.config = config  # local: this rank's heads and MLP columns
        self.dtype = dtype
        self.rank = rank
        self.clock = clock
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        layers = []
        for i in range(config.num_layers):
            layer = ParallelDecoderLayer(config, weights, f"model.layers.{i}.", {}, dtype)
            layer.clock = clock
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.Parameter(weights["model.norm.weight"].float(), requires_grad=False)
        self.lm_head: torch.Tensor | None = None
        if rank == 0:
            self.lm_head = weights.get("lm_head.weight", self.embed)
        self.rope = RotaryTable(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, torch.float32
        )

    def enable_quantized(self, max_rows: int) -> int:
        return 0  # dense only (see the module docstring)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:  # type: ignore[override]
        if int(batch.positions.max()) >= self.rope.max_positions:
            raise ValueError(f"position beyond max_position_embeddings={self.rope.max_positions}")
        decode_kernel = kv_cache.k[0].dtype == torch.float32 and kernels_available()
        plan = AttentionPlan.from_batch(batch, decode_kernel=decode_kernel)
        cos, sin = self.rope.lookup(batch.positions)
        x = F.embedding(batch.input_ids, self.embed).float()
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch.slot_mapping, kv_cache.k[i], kv_cache.v[i], plan)
        if self.lm_head is None:
            return x.new_empty(0)
        h = x[batch.logits_indices]
        h = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.config.rms_norm_eps)
        return F.linear(h.to(self.dtype), self.lm_head).float()
