"""What every router of the fleet keeps and the filter it applies, whatever kind of node it routes
to (`sluice worker`s in `router`, SGLang servers in `drivers/sglang/router`).

    filter   not already tried by this request; up and serving the model (the node kind says);
             circuit not open; not stalled or dead by node health; sluggish nodes only when no
             healthy one is left

Each kind then scores and picks among the candidates its own way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from drivers.fleet.breaker import CircuitBreaker
from observability.node_health import NodeHealthMonitor, NodeStatus

NodeT = TypeVar("NodeT")


class NoWorkerError(Exception):
    """No node passes the filter; the message says why each was left out."""


class NodeFilter:
    noun = "node"  # how the refusal names what it could not find ("no worker can take the request")
    nobody = "no node is known"  # the reason when there is no node at all

    def __init__(self, monitor: NodeHealthMonitor, shared: NodeFilter | None = None) -> None:
        """`shared`: the router of another node kind in the same fleet, whose breakers and counts of open
        streams this one keeps too (node ids are distinct across kinds)."""
        self.monitor = monitor
        self.breakers: dict[str, CircuitBreaker] = shared.breakers if shared is not None else {}
        self.in_flight: dict[str, int] = shared.in_flight if shared is not None else {}  # open streams, by node

    def filter(
        self, nodes: Iterable[tuple[str, str | None, NodeT]], now: float, exclude: Iterable[str] = ()
    ) -> list[NodeT]:
        """`nodes`: (id, why it cannot serve this request or None, node); `now` on the breakers'
        clock (time.monotonic()). Raises NoWorkerError naming why each node is out."""
        excluded = set(exclude)
        healthy: list[NodeT] = []
        sluggish: list[NodeT] = []
        why: dict[str, str] = {}
        for nid, unfit, node in nodes:
            breaker = self.breakers.get(nid)
            status = self.monitor.status(nid) if nid in self.breakers else NodeStatus.HEALTHY
            if nid in excluded:
                why[nid] = "already tried"
            elif unfit is not None:
                why[nid] = unfit
            elif breaker is not None and not breaker.allows(now):
                why[nid] = "circuit open"
            elif status in (NodeStatus.STALLED, NodeStatus.DEAD):
                why[nid] = str(status)
            elif status is NodeStatus.SLUGGISH:
                sluggish.append(node)
            else:
                healthy.append(node)
        chosen = healthy or sluggish
        if not chosen:
            detail = "; ".join(f"{n}: {r}" for n, r in why.items()) or self.nobody
            raise NoWorkerError(f"no {self.noun} can take the request ({detail})")
        return chosen
