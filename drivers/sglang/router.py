"""Which SGLang server gets a request: filter, then cache-aware pick with a load-imbalance guard.

    filter   up (its last /health_generate within `down_after_s`) and serves the model, then the
             fleet's filter (`drivers/fleet/routing`): circuit not open, not stalled or dead by
             node health, not already tried by this request; sluggish servers only when no
             healthy one is left
    guard    when the busiest and idlest candidates differ by more than `balance_abs` requests and
             the busiest has more than `balance_rel` times the idlest's, the least-loaded server
             takes it, whatever the cache says: a hot prefix spills instead of melting one server
    cache    the candidate holding the longest prefix of the prompt (from its KV events when they
             are on, else from the approximate tree of prompts routed there), if that prefix is at
             least `min_match_tokens`; ties go to the less loaded
    miss     the least-loaded candidate; ties rotate (a turn counter), so a run of cache misses on
             an idle fleet spreads instead of always landing on the same replica

Load is max(requests the server reported in /get_load or /metrics, streams this gateway has open
there), so a poll's lag never hides what was just sent.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from drivers.fleet.routing import NodeFilter
from drivers.sglang.config import CacheRoutingConfig
from drivers.sglang.kv_events import KVEventSubscriber
from drivers.sglang.prefix_tree import PrefixTree
from observability.node_health import NodeHealthMonitor


@dataclass
class ServerNode:
    """One SGLang server as the gateway knows it, from its polls."""

    id: str  # host:port: the same name in every gateway replica
    address: str
    model: str | None = None  # served model name (/v1/models); None: not read yet
    stale: bool = False  # it was down since: read its facts again (it may have been replaced)
    max_model_len: int = 0
    incremental: bool = False  # started with --incremental-streaming-output
    up: bool = False  # the last /health_generate answered 200
    last_ok: float = 0.0  # time.monotonic() of that answer
    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None  # fraction of its KV pool in use, when /metrics says
    load_source: str | None = None  # where running / waiting come from: "/get_load", "/metrics", "" (none); None: not probed
    detail: str = "not polled yet"
    restarts: int = 0  # times it came back after being down
    extra: dict[str, object] = field(default_factory=dict)


class Pick(enum.StrEnum):
    CACHE = "cache"
    MISS = "miss"
    BALANCE = "balance"


def _unfit(node: ServerNode, model: str, now: float, fresh_s: float) -> str | None:
    if not node.up or now - node.last_ok > fresh_s:
        return f"down ({node.detail})"
    if node.model != model:
        return "does not serve the model"
    return None


class CacheAwareRouter(NodeFilter):
    noun = "SGLang server"
    nobody = "no server configured"

    def __init__(self, config: CacheRoutingConfig, monitor: NodeHealthMonitor, shared: NodeFilter | None = None) -> None:
        super().__init__(monitor, shared)
        self.config = config
        self.trees: dict[str, PrefixTree] = {}
        self.events: dict[str, KVEventSubscriber] = {}
        self.picks: dict[Pick, int] = {p: 0 for p in Pick}
        self._turn = 0

    def load(self, node: ServerNode) -> int:
        return max(node.running + node.waiting, self.in_flight.get(node.id, 0))

    def tree(self, node_id: str) -> PrefixTree:
        tree = self.trees.get(node_id)
        if tree is None:
            tree = self.trees[node_id] = PrefixTree(self.config.page_size, self.config.max_pages_per_server)
        return tree

    def cached(self, node_id: str, prompt: list[int]) -> int:
        """Leading prompt tokens the server probably holds."""
        events = self.events.get(node_id)
        if events is not None and events.connected:
            return events.index.match(prompt)
        return self.tree(node_id).match(prompt)

    def candidates(
        self, nodes: Iterable[ServerNode], model: str, now: float, fresh_s: float, exclude: Iterable[str] = ()
    ) -> list[ServerNode]:
        """The filter (`NodeFilter.filter`); `now` is time.monotonic(), the clock of polls and breakers."""
        return self.filter(((n.id, _unfit(n, model, now, fresh_s), n) for n in nodes), now, exclude)

    def pick(self, candidates: list[ServerNode], prompt: list[int]) -> tuple[ServerNode, Pick]:
        loads = {c.id: self.load(c) for c in candidates}
        busiest, idlest = max(loads.values()), min(loads.values())
        c = self.config
        if busiest - idlest > c.balance_abs and busiest > idlest * c.balance_rel:
            return self._chosen(self._least_loaded(candidates, loads), Pick.BALANCE)
        matches = {n.id: self.cached(n.id, prompt) for n in candidates}
        best = max(matches.values())
        if best >= max(1, c.min_match_tokens):
            holders = [n for n in candidates if matches[n.id] == best]
            return self._chosen(self._least_loaded(holders, loads), Pick.CACHE)
        return self._chosen(self._least_loaded(candidates, loads), Pick.MISS)

    def _least_loaded(self, nodes: list[ServerNode], loads: dict[str, int]) -> ServerNode:
        low = min(loads[n.id] for n in nodes)
        tied = [n for n in nodes if loads[n.id] == low]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _chosen(self, node: ServerNode, why: Pick) -> tuple[ServerNode, Pick]:
        self.picks[why] += 1
        return node, why

    def routed(self, node_id: str, prompt: list[int]) -> None:
        """The prompt went to this server: its radix cache will hold it (approximate tree)."""
        self.tree(node_id).insert(prompt)
