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
    # context_lens as an int64 tensor on the batch's device; set by `to()` (a device step must not build
    # it from the list inside a CUDA graph), None on the CPU path.
    context_lens_tensor: torch.Tensor | None = None

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its tensors on `device`: one host-to-device copy each, no sync."""
        return ForwardBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            query_starts=self.query_starts,
            query_lens=self.query_lens,
            context_lens=self.context_lens,
            block_tables=self.block_tables.to(device, non_blocking=True),
            logits_indices=self.logits_indices.to(device, non_blocking=True),
            block_size=self.block_size,
            context_lens_tensor=torch.tensor(self.context_lens, dtype=torch.int64).to(device, non_blocking=True),
        )

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
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> KVCache:
        """`pin_memory`: page-locked host memory, for a host pool that a GPU copies to and from."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if pin_memory:  # allocated page-locked, not copied into it: the default host pool is 4 GiB
            return cls(
                k=[torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(num_layers)],
                v=[torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(num_layers)],
            )
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    @property
    def num_blocks(self) -> int:
        return int(self.k[0].shape[0])
