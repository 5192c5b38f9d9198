"""The hand-off from the model runner to the model: one flattened batch per step.

A step mixes prefill chunks and decodes. All their new tokens are laid end to
end in one 1-D tensor of T tokens:

    tokens:  | seq0 chunk (q0 tokens) | seq1 decode (1) | seq2 decode (1) | ...
    offsets: 0                        q0                q0+1              ...

For sequence i, `query_lens[i]` new tokens start at `query_starts[i]`; they sit
at positions `context_lens[i] - query_lens[i] .. context_lens[i] - 1` of that
sequence, and attend to every earlier token of it (causally), whose K/V live in
the paged cache at the blocks of `block_tables[i]`. The K/V of the new tokens
are written first, to `slot_mapping` (block_id * block_size + offset_in_block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot each new token's K/V is written to
    query_starts: list[int]  # per sequence: first index into T
    query_lens: list[int]  # per sequence: number of new tokens this step
    context_lens: list[int]  # per sequence: tokens in the cache after this step (computed + new)
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0 past each sequence's blocks
    logits_indices: torch.Tensor  # [S'] int64: indices into T whose logits the runner wants
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass
class KVCache:
    """The paged KV pool: per layer one K and one V tensor of
    [num_blocks, block_size, num_kv_heads, head_dim], allocated once."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
        )
