"""Which prompt prefixes each worker's KV cache holds, as the workers report it and the router reads it.

The worker keeps a ledger (`PrefixLedger`) of the prefix keys its requests came with
(`SubmitRequest.prefix_key`: the router's hash of the prompt's first KV blocks, salted per tenant),
most recent last, trimmed so that the prompts' blocks never add up to more than its KV pool: about
what its engines' LRU prefix cache can keep. It is an estimate (the engine evicts block by block and
running requests take room too), published with every heartbeat (`WorkerInfo.prefixes`).

The router reads it (`PrefixView`) two ways:
    holds   the worker lists the key, or this router sent the key there since the worker's last
            heartbeats (`sent_ttl_s`): its blocks are there, send the request there
    fits    the blocks of the prefixes the worker was brought within `hot_s`, plus this prompt's,
            fit in its pool: a new prefix goes to its ring home only if so, else clockwise to the
            first worker where it fits, so that a few big prefixes on a small fleet do not evict one
            another on one worker while the other workers' caches sit idle
Both read heartbeats, which every gateway sees alike, so two gateways still place a prefix on the
same worker without talking to each other (what one of them sent in the last second or two aside).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from drivers.fleet.wire import HeldPrefix, WorkerInfo

KEEP = 256  # prefixes a worker reports at most (the most recent): a heartbeat stays a few KB
BLOCK_TOKENS = 16  # tokens per KV block of the native engine (engine_native/config.py CacheConfig)


def blocks_of(tokens: int, block_tokens: int) -> int:
    """KV blocks a prompt of `tokens` takes (the last one partly filled)."""
    return -(-tokens // block_tokens)


class PrefixLedger:
    """The worker's side: prefix keys by recency, each with the blocks of its latest prompt."""

    def __init__(self, keep: int = KEEP, block_tokens: int = BLOCK_TOKENS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._keep, self._block_tokens, self._clock = keep, block_tokens, clock
        self._entries: OrderedDict[int, tuple[int, float]] = OrderedDict()  # key -> (blocks, last brought)

    def record(self, key: int, prompt_tokens: int) -> None:
        self._entries[key] = (blocks_of(prompt_tokens, self._block_tokens), self._clock())
        self._entries.move_to_end(key)

    def held(self, capacity_blocks: int) -> list[HeldPrefix]:
        """The keys, most recent last, as many as fit in `capacity_blocks` (0: unknown, no limit) and KEEP."""
        now = self._clock()
        out: list[HeldPrefix] = []
        total = 0
        for key, (blocks, at) in reversed(self._entries.items()):
            total += blocks
            if len(out) == self._keep or (capacity_blocks and total > capacity_blocks):
                break
            out.append(HeldPrefix(key, blocks, round(now - at, 3)))
        for key in list(self._entries)[: len(self._entries) - len(out)]:  # evicted: forget them
            del self._entries[key]
        out.reverse()
        return out


class PrefixView:
    """The router's side: the workers' reports plus what this router placed since."""

    def __init__(self, hot_s: float, sent_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hot_s, self.sent_ttl_s, self._clock = hot_s, sent_ttl_s, clock
        self._reports: dict[str, tuple[WorkerInfo, dict[int, HeldPrefix], int]] = {}  # id -> (info, by key, hot blocks)
        # Per worker: prefixes this router placed there that its heartbeats do not list yet -> (blocks, when).
        self._placed: dict[str, OrderedDict[int, tuple[int, float]]] = {}

    def _reported(self, info: WorkerInfo) -> tuple[dict[int, HeldPrefix], int]:
        known = self._reports.get(info.id)
        if known is None or known[0] is not info:  # a new heartbeat: index it once
            by_key = {p.key: p for p in info.prefixes}
            hot = sum(p.blocks for p in info.prefixes if p.idle_s < self.hot_s)
            known = self._reports[info.id] = (info, by_key, hot)
            placed = self._placed.get(info.id)
            if placed:
                for key in by_key.keys() & placed.keys():
                    del placed[key]  # the worker says so itself now
        return known[1], known[2]

    def _placed_here(self, worker_id: str) -> OrderedDict[int, tuple[int, float]]:
        placed = self._placed.setdefault(worker_id, OrderedDict())
        due = self._clock() - self.sent_ttl_s
        while placed and next(iter(placed.values()))[1] < due:
            placed.popitem(last=False)
        return placed

    def holds(self, info: WorkerInfo, key: int) -> bool:
        return key in self._reported(info)[0] or key in self._placed_here(info.id)

    def fits(self, info: WorkerInfo, blocks: int) -> bool:
        capacity = info.load.kv_blocks_total
        if not capacity:
            return True  # a pool of unknown size (a synthetic engine): the ring decides alone
        hot = self._reported(info)[1] + sum(b for b, _ in self._placed_here(info.id).values())
        return hot + blocks <= capacity

    def placed(self, info: WorkerInfo, key: int, blocks: int) -> None:
        """This router sent `key` to the worker; until its heartbeat lists it, count it here."""
        if key in self._reported(info)[0]:
            return
        placed = self._placed_here(info.id)
        placed[key] = (blocks, self._clock())
        placed.move_to_end(key)

    def forget(self, worker_ids: set[str]) -> None:
        """Drop what is known of workers that left the view."""
        for known in (self._reports, self._placed):
            for wid in [w for w in known if w not in worker_ids]:
                del known[wid]
