"""Where a rank sits in a tensor x pipeline parallel engine.

    rank = stage * tp + tp_rank          tp = 2, pp = 2:   stage 0: ranks 0 1   (layers 0 .. L/2-1)
                                                           stage 1: ranks 2 3   (layers L/2 .. L-1)

Rank 0 (stage 0, tp rank 0) is the engine: scheduler, embedding, final norm, LM head and sampler.
The ranks of a stage all-reduce among themselves (their TP group); activations go from each rank
to the rank of the same tp rank in the next stage; the last stage's tp rank 0 sends the rows to
sample back to rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Placement:
    tp: int
    pp: int
    rank: int
    num_layers: int = 0  # the whole model's; set by the loader, which reads it
    micro_batches: int = 0  # a step's pipeline micro-batches; 0: one per stage

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches or self.pp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def layers(self) -> range:
        """This stage's layers: contiguous, the first stages one longer when they do not divide."""
        s, n, m = self.stage, self.num_layers, self.pp
        return range(s * n // m, (s + 1) * n // m)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp

    @property
    def last_stage_head_rank(self) -> int:
        """The rank that sends the sampled rows' hidden states back to rank 0."""
        return (self.pp - 1) * self.tp

    def tp_group(self) -> dist.ProcessGroup | None:
        """This stage's TP group (None when tp == 1: no all-reduce). Every rank must call this, in
        the same order, since torch.distributed creates each group on all ranks."""
        if self.tp == 1:
            return None
        groups = [dist.new_group(list(range(s * self.tp, (s + 1) * self.tp))) for s in range(self.pp)]
        return groups[self.stage]
