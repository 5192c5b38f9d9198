"""Which worker gets a request: filter, then score, then pick.

    filter   READY and serves the model, then the fleet's filter (`routing`): circuit not open,
             not stalled or dead by node health, not already tried by this request; sluggish
             workers only when no healthy one is left
    score    load = max(streams the worker reported open, streams this router has open there)
                    + its KV usage (0..1), so a heartbeat's lag never hides what we just sent
    pick     round-robin     the next candidate in id order
             least-loaded    the lowest load (ties: the lower id)
             prefix-affinity among the workers under a bounded load
                             ceil(load_factor * (total load + 1) / workers) (so a hot prefix
                             spills to the next worker instead of melting one), in ring order
                             clockwise from the prompt's prefix hash on a ring of virtual nodes:
                             the first that holds the prefix (its heartbeats list it, or this
                             router just sent it there: `prefixes`), else the first whose KV pool
                             has room for it beside the prefixes it was brought lately, else the
                             first

The prefix hash covers the prompt's first `affinity_blocks` KV blocks of `block_size` tokens,
salted with the tenant id like the engine's own prefix cache, so one tenant's system prompt
always lands where its KV blocks are. The ring is a function of worker ids only, and what workers
hold comes from their heartbeats: two gateways with the same membership place a prefix on the same
worker without talking to each other.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from drivers.fleet.prefixes import BLOCK_TOKENS, PrefixView, blocks_of
from drivers.fleet.routing import NodeFilter, NoWorkerError
from drivers.fleet.wire import WorkerInfo, WorkerState
from observability.node_health import NodeHealthMonitor

__all__ = ["FleetRouter", "HashRing", "NoWorkerError", "Policy", "RouterConfig", "prefix_key", "stable_hash"]


class Policy(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    PREFIX_AFFINITY = "prefix-affinity"


@dataclass(frozen=True)
class RouterConfig:
    policy: Policy = Policy.PREFIX_AFFINITY
    """How a worker is picked among the candidates (--fleet-policy)."""
    block_size: int = BLOCK_TOKENS
    """Tokens per KV block of the workers' engines (the native engine's)."""
    affinity_blocks: int = 4
    """Leading full blocks of the prompt that make its prefix key."""
    load_factor: float = 1.25
    """Bounded load of prefix affinity: no worker takes more than this times the mean (plus one)."""
    virtual_nodes: int = 100
    """Points per worker on the hash ring (evens out the arcs)."""
    prefix_hot_s: float = 60.0
    """A prefix brought to a worker within this long takes room in its KV pool when placing new ones."""
    prefix_sent_ttl_s: float = 3.0
    """How long a prefix this router sent counts as held before the worker's heartbeat lists it."""


def stable_hash(data: bytes) -> int:
    """63 bits of BLAKE2b (a non-negative int64 on the wire): the same in every process (Python's
    hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


def prefix_key(prompt: list[int], tenant_id: str | None, config: RouterConfig) -> int | None:
    blocks = min(config.affinity_blocks, len(prompt) // config.block_size)
    if blocks == 0:
        return None  # shorter than one block: nothing cacheable to be near
    head = array("I", prompt[: blocks * config.block_size]).tobytes()
    return stable_hash((tenant_id or "").encode() + b"\0" + head)


class HashRing:
    def __init__(self, worker_ids: Iterable[str], virtual_nodes: int) -> None:
        points = sorted(
            (stable_hash(f"{wid}#{v}".encode()), wid) for wid in sorted(set(worker_ids)) for v in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._ids = [w for _, w in points]
        self.members = frozenset(self._ids)

    def walk(self, key: int) -> list[str]:
        """Distinct workers clockwise from `key`."""
        if not self._ids:
            return []
        start = bisect.bisect_left(self._hashes, key)
        seen: dict[str, None] = {}
        for i in range(len(self._ids)):
            seen.setdefault(self._ids[(start + i) % len(self._ids)], None)
            if len(seen) == len(self.members):
                break
        return list(seen)


def _unfit(info: WorkerInfo, model: str) -> str | None:
    if info.state is not WorkerState.READY:
        return str(info.state)
    if not any(card.id == model for card in info.models):
        return "does not serve the model"
    return None


class FleetRouter(NodeFilter):
    noun = "worker"
    nobody = "no worker has joined"

    def __init__(self, config: RouterConfig, monitor: NodeHealthMonitor) -> None:
        super().__init__(monitor)
        self.config = config
        self._ring = HashRing([], config.virtual_nodes)
        self._turn = 0
        self.prefixes = PrefixView(config.prefix_hot_s, config.prefix_sent_ttl_s)

    def load(self, info: WorkerInfo) -> float:
        reported = max(info.load.in_flight, info.load.running + info.load.waiting)
        return max(reported, self.in_flight.get(info.id, 0)) + info.load.kv_usage

    def candidates(
        self, view: Mapping[str, WorkerInfo], model: str, now: float, exclude: Iterable[str] = ()
    ) -> list[WorkerInfo]:
        """The filter (`NodeFilter.filter`); `now` on the breakers' clock (time.monotonic())."""
        return self.filter(((wid, _unfit(view[wid], model), view[wid]) for wid in sorted(view)), now, exclude)

    def pick(
        self, candidates: list[WorkerInfo], prompt: list[int], tenant_id: str | None, members: Iterable[str] = ()
    ) -> WorkerInfo:
        """`members`: every worker in the view; the ring is built over them, not over the candidates,
        so a worker filtered out for one request moves only its own keys (consistent hashing)."""
        policy = self.config.policy
        if policy is Policy.ROUND_ROBIN:
            self._turn += 1
            return candidates[self._turn % len(candidates)]
        if policy is Policy.PREFIX_AFFINITY:
            key = prefix_key(prompt, tenant_id, self.config)
            if key is not None:
                blocks = blocks_of(len(prompt), self.config.block_size)
                return self._affine(candidates, key, blocks, frozenset(members) | {c.id for c in candidates})
        return min(candidates, key=lambda c: (self.load(c), c.id))

    def _affine(self, candidates: list[WorkerInfo], key: int, blocks: int, members: frozenset[str]) -> WorkerInfo:
        by_id = {c.id: c for c in candidates}
        if self._ring.members != members:
            self._ring = HashRing(members, self.config.virtual_nodes)
            self.prefixes.forget(set(members))
        loads = {wid: self.load(c) for wid, c in by_id.items()}
        bound = math.ceil(self.config.load_factor * (sum(loads.values()) + 1) / len(by_id))
        order = [by_id[wid] for wid in self._ring.walk(key) if wid in by_id]
        under = [c for c in order if loads[c.id] < bound] or order
        chosen = (next((c for c in under if self.prefixes.holds(c, key)), None)
                  or next((c for c in under if self.prefixes.fits(c, blocks)), None)
                  or under[0])
        self.prefixes.placed(chosen, key, blocks)
        return chosen

    def home(self, view: Mapping[str, WorkerInfo], prompt: list[int], tenant_id: str | None) -> str | None:
        """Where prefix affinity puts this prompt when nobody is loaded (for tests and the console)."""
        key = prefix_key(prompt, tenant_id, self.config)
        ring = HashRing(view, self.config.virtual_nodes)
        order = ring.walk(key) if key is not None else []
        return order[0] if order else None
