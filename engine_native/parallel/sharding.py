"""Which slice of every weight one tensor-parallel rank holds.

Attention heads are split into `tp` contiguous ranges of query heads (uneven when they do not
divide: SmolLM2's 9 heads at tp = 2 are 4 + 5). A rank holds every KV head one of its query heads
reads, so a KV head whose group straddles two ranks is replicated on both (its K/V computed and
cached twice). Locally the heads must keep one group size (the paged-attention kernels map query
head h to KV head h // g), so a group with fewer local query heads than the largest is padded with
zero heads: a zero query row and a zero output column, which add exactly nothing.

    9 heads, 3 KV heads (g = 3), tp = 2:
        global heads   0 1 2 | 3 4 5 | 6 7 8        KV heads 0 | 1 | 2
        rank 0         0 1 2 | 3 . .                KV 0, 1    (. = zero pad head)
        rank 1                 4 5 . | 6 7 8        KV 1, 2    (KV 1 replicated)

The MLP's intermediate columns are split in contiguous ranges: gate/up rows (column-parallel),
down columns (row-parallel, followed by an all-reduce). Layer norms are replicated, the embedding
is on every rank of the first pipeline stage, the final norm and LM head on rank 0 only, which
alone samples (docs/parallelism.md says why); a pipeline stage keeps only its own layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine_native.config import ModelConfig
from engine_native.parallel.placement import Placement

# Reads rows [r0, r1) and columns [c0, c1) of a named full weight (None = all), so that a loader
# that can slice on disk (safetensors) never materialises the whole tensor.
SliceReader = Callable[[slice, slice], torch.Tensor]


@dataclass(frozen=True)
class HeadLayout:
    """Rank-local attention heads: query head slots (None = zero pad) grouped by local KV head."""

    q_heads: tuple[int | None, ...]  # global query head of each local slot, grouped by local KV head
    kv_heads: tuple[int, ...]  # global KV heads held here, in local order

    @classmethod
    def for_rank(cls, num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadLayout:
        if not 1 <= tp <= num_heads:
            raise ValueError(f"tensor_parallel_size {tp} must be between 1 and the {num_heads} attention heads")
        g = num_heads // num_kv_heads
        lo, hi = rank * num_heads // tp, (rank + 1) * num_heads // tp
        kv = tuple(range(lo // g, (hi - 1) // g + 1))
        per_kv = {k: [h for h in range(lo, hi) if h // g == k] for k in kv}
        local_g = max(len(v) for v in per_kv.values())
        slots = tuple(per_kv[k][s] if s < len(per_kv[k]) else None for k in kv for s in range(local_g))
        return cls(q_heads=slots, kv_heads=kv)

    @property
    def num_pad_heads(self) -> int:
        return sum(h is None for h in self.q_heads)


@dataclass(frozen=True)
class ShardPlan:
    """Everything one rank needs to slice the full model's weights."""

    config: ModelConfig  # the full model's
    placement: Placement

    @property
    def tp(self) -> int:
        return self.placement.tp

    @property
    def rank(self) -> int:
        """The rank within the stage's TP group."""
        return self.placement.tp_rank

    @property
    def heads(self) -> HeadLayout:
        c = self.config
        return HeadLayout.for_rank(c.num_heads, c.num_kv_heads, self.tp, self.rank)

    @property
    def mlp_range(self) -> tuple[int, int]:
        i = self.config.intermediate_size
        return self.rank * i // self.tp, (self.rank + 1) * i // self.tp

    @property
    def local_config(self) -> ModelConfig:
        """The model as this rank's layers see it: its own heads and MLP columns."""
        heads = self.heads
        lo, hi = self.mlp_range
        return replace(
            self.config, num_heads=len(heads.q_heads), num_kv_heads=len(heads.kv_heads), intermediate_size=hi - lo,
            num_layers=len(self.placement.layers),
        )

    def keeps(self, name: str) -> bool:
        """Whether this rank holds any of the weight `name` (HF naming)."""
        p = self.placement
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in p.layers
        if name == "model.embed_tokens.weight":
            return p.is_first_stage
        return p.rank == 0  # the final norm and the LM head

    def shard(self, name: str, read: SliceReader) -> torch.Tensor:
        """This rank's part of the weight `name`, read through `read`."""
        d = self.config.head_dim
        every = slice(None)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return self._heads(self.heads.q_heads, lambda a, b: read(slice(a * d, b * d), every), dim=0)
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            kv = self.heads.kv_heads
            return read(slice(kv[0] * d, (kv[-1] + 1) * d), every)
        if name.endswith("o_proj.weight"):
            return self._heads(self.heads.q_heads, lambda a, b: read(every, slice(a * d, b * d)), dim=1)
        lo, hi = self.mlp_range
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return read(slice(lo, hi), every)
        if name.endswith("down_proj.weight"):
            return read(every, slice(lo, hi))
        return read(every, every)

    def _heads(
        self, slots: tuple[int | None, ...], read: Callable[[int, int], torch.Tensor], dim: int
    ) -> torch.Tensor:
        """The head slots' rows (dim 0) or columns (dim 1), zeros for pad slots: one read of the span."""
        real = [h for h in slots if h is not None]
        first = min(real)
        span = read(first, max(real) + 1)
        d = self.config.head_dim
        parts = [
            span.narrow(dim, (h - first) * d, d) if h is not None else torch.zeros_like(span.narrow(dim, 0, d))
            for h in slots
        ]
        return torch.cat(parts, dim=dim).contiguous()
