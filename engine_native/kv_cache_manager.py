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
    the prefix-cache index and the blocks' own hashes agree
    a block in flight is not cached yet, and its request holds blocks

Prefix caching (when enabled): every full block of a request is named by a
SHA-256 chain over a salt and the token ids (`block_hash.py`). The salt
is the tenant id, so tenants never share cache unless configured to. A new
request first looks up the longest run of its full blocks already in the cache
and takes them with a reference (no compute); blocks whose reference count drops
to zero stay cached on the free list and are evicted least-recently-freed first
when a block is needed. The full prompt blocks a request will compute are noted
as in flight until computed, so that a request arriving with the same prefix
can wait for them (the scheduler) instead of computing them a second time.

    block table:  | cached, shared (ref >= 1) | own, computed | own, being filled |
                  |<-- num_cached_tokens -->|
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine_native.block_hash import BlockHash, block_hash, root_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free list (in eviction order), reference counts and the prefix-cache index of the blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # Low ids first, so that a fresh engine's tables are easy to read in logs. The head is
        # evicted first: blocks are appended when their last reference goes.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take another reference to cached blocks, pulling unreferenced ones off the free list."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def register(self, block: int, name: BlockHash) -> None:
        """Name a full, computed block; a hash already owned by another block is left alone."""
        if name not in self.cached and self.block_hash[block] is None:
            self.cached[name] = block
            self.block_hash[block] = name

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None

    def free_block_ids(self) -> list[int]:
        return list(self._free)


@dataclass(frozen=True)
class KVCacheUsage:
    num_blocks: int
    num_used: int

    @property
    def fraction_used(self) -> float:
        return self.num_used / self.num_blocks


@dataclass(frozen=True)
class PrefixLookup:
    """What the cache holds of a prompt's full blocks."""

    blocks: list[int]  # the longest cached run, in order
    uncached: list[BlockHash]  # the hashes of the full blocks after it: what the request would compute
    in_flight_by: str | None  # the request computing the first of `uncached` right now, if any


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        share_prefix_across_tenants: bool = False,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.share_prefix_across_tenants = share_prefix_across_tenants
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hash chain of each request's full blocks
        # Full prompt blocks admitted requests are computing, not yet cached: hash -> request id.
        self._in_flight: dict[BlockHash, str] = {}
        self._in_flight_of: dict[str, list[BlockHash]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    def salt(self, tenant_id: str | None) -> str | None:
        """The hash-chain seed of a tenant's blocks: its id, unless tenants share the cache."""
        return None if self.share_prefix_across_tenants else tenant_id

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

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

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_prefix: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold `num_total_tokens` tokens (computed + new), first
        taking `cached_prefix` (`lookup_prefix(...).blocks`, for a request that holds nothing yet).

        Returns the newly added block ids (possibly empty), or None if the
        pool cannot provide them; in that case nothing changes.
        """
        prefix = cached_prefix or []
        needed = max(0, cdiv(num_total_tokens, self.block_size) - len(self.block_table(request_id)) - len(prefix))
        # Unreferenced cached blocks sit on the free list: taking them leaves fewer to allocate from.
        reclaimed = sum(1 for b in prefix if self.pool.ref_cnt[b] == 0)
        if needed > self.pool.num_free - reclaimed:
            return None
        table = self._tables.setdefault(request_id, [])
        if prefix:
            self.pool.touch(prefix)
            table.extend(prefix)
            self._hashes[request_id] = [self.pool.block_hash[b] for b in prefix]  # type: ignore[misc]
        new_blocks = self.pool.take(needed)
        table.extend(new_blocks)
        return prefix + new_blocks

    def lookup_prefix(self, token_ids: list[int], salt: str | None) -> PrefixLookup:
        """The longest cached run of `token_ids`' full blocks, the hashes of the full blocks past it and
        whether another request is computing the first of them now. At least one token is always left
        to compute, since the step that computes it samples the next."""
        if not self.enable_prefix_caching:
            return PrefixLookup([], [], None)
        bs = self.block_size
        blocks: list[int] = []
        uncached: list[BlockHash] = []
        parent = root_hash(salt)
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            b = None if uncached else self.pool.cached.get(h)
            if b is None:
                uncached.append(h)
            else:
                blocks.append(b)
            parent = h
        return PrefixLookup(blocks, uncached, self._in_flight.get(uncached[0]) if uncached else None)

    def note_in_flight(self, request_id: str, hashes: list[BlockHash]) -> None:
        """The request now computes these full blocks (from `lookup_prefix`); `cache_full_blocks`
        or `free` ends that. A block another request already computes stays that one's."""
        mine = self._in_flight_of.setdefault(request_id, [])
        for h in hashes:
            if self._in_flight.setdefault(h, request_id) == request_id:
                mine.append(h)

    def cache_full_blocks(
        self, request_id: str, num_computed_tokens: int, token_ids: Callable[[int, int], list[int]], salt: str | None
    ) -> None:
        """Register the request's blocks that are now full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = self._tables.get(request_id, [])
        hashes = self._hashes.setdefault(request_id, [])
        for i in range(len(hashes), min(num_computed_tokens // bs, len(table))):
            parent = hashes[-1] if hashes else root_hash(salt)
            h = block_hash(parent, token_ids(i * bs, (i + 1) * bs))
            self.pool.register(table[i], h)
            hashes.append(h)
            self._in_flight.pop(h, None)  # cached now, whoever was computing it

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request that holds nothing could get room for `num_tokens` now."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_free

    def free(self, request_id: str) -> None:
        """Release every block the request holds; a no-op for unknown ids."""
        blocks = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        for h in self._in_flight_of.pop(request_id, []):
            if self._in_flight.get(h) == request_id:
                del self._in_flight[h]
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
        for h, b in self.pool.cached.items():
            if self.pool.block_hash[b] != h:
                raise AssertionError(f"cache index names block {b} for a hash it does not carry")
        for h, request_id in self._in_flight.items():
            if request_id not in self._tables or h in self.pool.cached:
                raise AssertionError(f"a block in flight for {request_id} is cached already or its request holds none")
