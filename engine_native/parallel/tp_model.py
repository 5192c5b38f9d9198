"""One tensor-parallel rank's slice of a Llama-family model.

Each layer is the single-process `DecoderLayer` built on the rank's local config (its heads, its
MLP columns: `sharding.ShardPlan`), so q/k/v and gate/up are column-parallel for free. The output
and down projections are row-parallel: each rank's product is a partial sum of the full one, and
an all-reduce adds them before the residual:

    x ─ norm ─ qkv(local heads) ─ attention(local KV pool) ─ o(local cols) ─ all-reduce ─ + x
      ─ norm ─ gate/up(local cols) ─ silu·mul ─ down(local rows) ─ all-reduce ─ + x

two all-reduces of [T, hidden] fp32 per layer, within the rank's pipeline stage. The embedding is
replicated on the first stage (a gather costs nothing, a vocab-parallel one would need a third
all-reduce); the final norm and LM head run on rank 0 only, which alone samples.

With pipeline stages (`placement.py`), the step's sequences are cut into micro-batches
(`micro_batch.py`); each stage sends a micro-batch's residual on (isend) and starts the next one at
once, so stage s computes micro-batch i + 1 while stage s + 1 computes micro-batch i:

    stage 0:  [mb0][mb1]                          then receives mb0's, mb1's sampled rows, LM head
    stage 1:       [mb0][mb1] -> rows to rank 0

This path is dense: the GGUF-block (quantized) kernels and the fused decoder are single-process only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine_native.config import ModelConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.attention import AttentionPlan
from engine_native.model.attention_backends import AttentionBackend
from engine_native.model.llama import DecoderLayer, cache_in_kernels
from engine_native.model.quant import NO_ROUNDING, ActivationRounding
from engine_native.model.rope import RotaryTable
from engine_native.parallel.comm import CollectiveClock
from engine_native.parallel.micro_batch import split_micro_batches
from engine_native.parallel.placement import Placement

_ROW_PARALLEL = frozenset({"o_weight", "down_weight"})


class ParallelDecoderLayer(DecoderLayer):
    """`DecoderLayer` whose row-parallel products are summed across the stage's TP group before use."""

    clock: CollectiveClock
    tp_group: dist.ProcessGroup | None

    def _linear(
        self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None, keep_dtype: bool = False,
        pure_decode: bool = False, step_rows: int | None = None,
    ) -> torch.Tensor:
        # `pure_decode` and `step_rows` change nothing here: the TP shards keep no quantized blocks or panels
        # (enable_quantized and pack_dense are off), so every step takes the dense GEMM.
        if name in _ROW_PARALLEL and self.tp_group is not None:
            out = super()._linear(x, name, bias)  # the partial sums are added in fp32, never in bf16
            self.clock.all_reduce(out, self.tp_group)
            return out
        return super()._linear(x, name, bias, keep_dtype)


class TensorParallelLlama(nn.Module):
    """Implements `CausalLM` for one rank. `forward` returns logits on rank 0, an empty tensor elsewhere."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        placement: Placement,
        clock: CollectiveClock,
    ) -> None:
        super().__init__()
        self.config = config  # local: this rank's heads, MLP columns and layers
        self.dtype = dtype
        self.placement = placement
        self.clock = clock
        self.attention_backend: AttentionBackend | None = None  # the layers' own CPU path
        self.prefill_attention_dtype = torch.float32
        self.prefill_attention_kernel_on = False  # a rank's plan keeps PyTorch's fp32 SDPA for its prefill chunks
        tp_group = placement.tp_group()
        self.embed: torch.Tensor | None = weights.get("model.embed_tokens.weight")
        layers = []
        for i in placement.layers:
            layer = ParallelDecoderLayer(config, weights, f"model.layers.{i}.", {}, dtype)
            layer.clock, layer.tp_group = clock, tp_group
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.final_norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        if placement.rank == 0:
            self.final_norm = weights["model.norm.weight"].float()
            self.lm_head = weights.get("lm_head.weight", self.embed)
        self.rope = RotaryTable(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, torch.float32
        )

    def enable_quantized(self, max_rows: int, amx_max_rows: int = 0, panel_max_rows: int = 0,
                         rounding: ActivationRounding = NO_ROUNDING) -> int:
        return 0  # dense only (see the module docstring)

    def pack_dense(self, batch_hint: int = 32, bf16_panel_max_rows: int = 0) -> int:
        return 0  # plain dense weights: the TP shards are not pre-packed (yet)

    def place_on(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError("a tensor-parallel engine runs on the CPU (gloo) only so far")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:  # type: ignore[override]
        if int(batch.positions.max()) >= self.rope.max_positions:
            raise ValueError(f"position beyond max_position_embeddings={self.rope.max_positions}")
        p = self.placement
        if p.pp == 1:
            return self._head(self._layers(self._embed(batch), batch, kv_cache)[batch.logits_indices])
        hidden = self.config.hidden_size
        sends = []
        for mb in split_micro_batches(batch, p.num_micro_batches):
            if p.is_first_stage:
                x = self._embed(mb)
            else:
                x = self.clock.recv(torch.empty(mb.num_tokens, hidden), p.prev_rank)
            x = self._layers(x, mb, kv_cache)
            if not p.is_last_stage:
                sends.append(self.clock.isend(x, p.next_rank))
            elif p.tp_rank == 0:
                sends.append(self.clock.isend(x[mb.logits_indices].contiguous(), 0))
        for work in sends:
            work.wait()
        if p.rank != 0:
            return torch.empty(0)
        rows = [
            self.clock.recv(torch.empty(int(mb.logits_indices.shape[0]), hidden), p.last_stage_head_rank)
            for mb in split_micro_batches(batch, p.num_micro_batches)
        ]
        return self._head(torch.cat(rows))

    def _embed(self, batch: ForwardBatch) -> torch.Tensor:
        assert self.embed is not None
        return F.embedding(batch.input_ids, self.embed).float()

    def _layers(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        decode_kernel = cache_in_kernels(kv_cache.k[0])
        plan = AttentionPlan.from_batch(batch, decode_kernel=decode_kernel, prefill_dtype=self.prefill_attention_dtype)
        cos, sin = self.rope.lookup(batch.positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch.slot_mapping, kv_cache.k[i], kv_cache.v[i], plan)
        return x

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None or self.final_norm is None:
            return h.new_empty(0)
        h = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.config.rms_norm_eps)
        return F.linear(h.to(self.dtype), self.lm_head).float()
