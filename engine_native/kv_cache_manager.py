"""Owns the paged KV cache's bookkeeping: which fixed-size blocks each request holds.

The pool of `num_blocks` blocks is sized once at start; the tensors behind it
(`forward_batch.KVCache`) are allocated once by the runner and never grow.
The scheduler never touches free lists: it asks `allocate_slots` for room for
N more tokens and gets the request's new block ids, or `None` when the pool
cannot provide them, which is its cue to preempt something.

Invariant (checked by `check_integrity`, run by the tests after every step):

    num_free + num_used == num_blocks
    every used block's ref count == the number of block tables that hold it
    no free block is held by any request; no block appears twice in one table

Reference counts are there so that a later prefix cache can share full
blocks between requests without changing this interface.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free list and reference counts of the physical blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # Low ids first, so that a fresh engine's tables are easy to read in logs.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)

    def free_block_ids(self) -> list[int]:
        return list(self._free)


@dataclass(frozen=True)
class KVCacheUsage:
    num_blocks: int
    num_used: int

    @property
    def fraction_used(self) -> float:
        return self.num_used / self.num_blocks


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> KVCacheUsage:
        return KVCacheUsage(self.pool.num_blocks, self.pool.num_blocks - self.pool.num_free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Extra blocks the request needs so that `num_total_tokens` tokens fit."""
        return max(0, cdiv(num_total_tokens, self.block_size) - len(self.block_table(request_id)))

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_total_tokens` tokens (computed + new).

        Returns the newly added block ids (possibly empty), or None if the
        pool cannot provide them; in that case nothing changes.
        """
        needed = self.blocks_needed(request_id, num_total_tokens)
        if needed > self.pool.num_free:
            return None
        new_blocks = self.pool.take(needed)
        self._tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request that holds nothing could get room for `num_tokens` now."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_free

    def free(self, request_id: str) -> None:
        """Release every block the request holds; a no-op for unknown ids."""
        blocks = self._tables.pop(request_id, None)
        if blocks:
            # Reversed: the tail of a sequence is the least likely to be shared later.
            self.pool.release(list(reversed(blocks)))

    def check_integrity(self) -> None:
        """Assert the invariant drawn in the module docstring."""
        owners = [0] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id} holds a block twice: {table}")
            for b in table:
                owners[b] += 1
        free = self.pool.free_block_ids()
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        for b in free:
            if owners[b] or self.pool.ref_cnt[b]:
                raise AssertionError(f"free block {b} is owned (owners={owners[b]})")
        num_used = sum(1 for b in range(self.pool.num_blocks) if owners[b])
        if num_used + len(free) != self.pool.num_blocks:
            raise AssertionError(
                f"free {len(free)} + used {num_used} != total {self.pool.num_blocks}: a block leaked"
            )
        for b in range(self.pool.num_blocks):
            if owners[b] and self.pool.ref_cnt[b] != owners[b]:
                raise AssertionError(f"block {b} has ref count {self.pool.ref_cnt[b]} but {owners[b]} owners")
