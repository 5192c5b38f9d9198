"""The waiting queue: strict priority between tiers, weighted fair sharing between tenants within one.

Within a priority value the next request comes from the tenant that has been
served the fewest weighted tokens (a virtual token counter, as in "Fairness in
Serving Large Language Models", Sheng et al. 2024): every token computed for the
first time charges its tenant `1 / weight` (a token recomputed after a preemption
is not charged again), so over time tenants of one tier get service in
proportion to their weights, and a tenant flooding the queue cannot starve
another. Within a tenant it is by arrival time plus `order_s_per_token` seconds per prompt token
(SchedulerConfig.prompt_order_ms_per_token): the prompts of a burst go shortest first, a later arrival
overtakes only a longer prompt that came less than the difference of their lengths times it before; 0 is
FCFS by arrival. A preempted request keeps its place (its key does not change).

A tenant's weight comes with its requests (`Request.tenant_weight`, set from the
tenant's record by the gateway); `SchedulerConfig.tenant_weights` overrides it.

A tenant that comes back after being idle has its counter lifted to the least
counter of the tenants that are waiting, so that idling does not bank credit.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping

from engine_native.request import Request

DEFAULT_TENANT = ""


def tenant_of(request: Request) -> str:
    return request.tenant_id or DEFAULT_TENANT


class FairShare:
    """Virtual token counters per tenant."""

    def __init__(self, overrides: Mapping[str, float] | None = None) -> None:
        self.overrides = dict(overrides or {})  # SchedulerConfig.tenant_weights: win over what requests carry
        self.carried: dict[str, float] = {}  # the weight the tenant's latest request carried
        self.counters: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        override = self.overrides.get(tenant)
        return override if override is not None else self.carried.get(tenant, 1.0)

    def set_weight(self, tenant: str, weight: float) -> None:
        """The weight a request of `tenant` carries; a change applies to the tokens charged from now."""
        self.carried[tenant] = weight

    def charge(self, tenant: str, tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weight(tenant)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def lift(self, tenant: str, floor: float) -> None:
        if self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor


class WaitingQueue:
    """priority -> tenant -> requests ordered by (arrival + prompt tokens x `order_s_per_token`, insertion)."""

    def __init__(self, fair_share: FairShare, order_s_per_token: float = 0.0) -> None:
        self.fair_share = fair_share
        self.order_s_per_token = order_s_per_token
        self._tiers: dict[int, dict[str, list[tuple[tuple[float, int], Request]]]] = {}
        self._counter = itertools.count()
        self._len = 0
        self._tokens = 0  # sum of num_tokens of the queued requests (their tokens do not change while queued)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._tiers):
            for queue in self._tiers[priority].values():
                for _, request in queue:
                    yield request

    def push(self, request: Request) -> None:
        tenants = self._tiers.setdefault(request.priority, {})
        tenant = tenant_of(request)
        self.fair_share.set_weight(tenant, request.tenant_weight)
        if tenant not in tenants:
            waiting = [self.fair_share.counter(t) for t in tenants]
            if waiting:
                self.fair_share.lift(tenant, min(waiting))
        queue = tenants.setdefault(tenant, [])
        place = request.arrival_time + request.num_prompt_tokens * self.order_s_per_token
        entry = ((place, next(self._counter)), request)
        bisect.insort(queue, entry, key=lambda e: e[0])
        self._len += 1
        self._tokens += request.num_tokens

    def _next(self) -> tuple[int, str]:
        priority = min(self._tiers)
        tenants = self._tiers[priority]
        # Least weighted service first; ties go to the tenant whose head stands first.
        tenant = min(tenants, key=lambda t: (self.fair_share.counter(t), tenants[t][0][0]))
        return priority, tenant

    def peek(self) -> Request:
        priority, tenant = self._next()
        return self._tiers[priority][tenant][0][1]

    def pop(self) -> Request:
        priority, tenant = self._next()
        return self._take(priority, tenant, 0)

    def remove(self, request: Request) -> bool:
        queue = self._tiers.get(request.priority, {}).get(tenant_of(request))
        if queue is None:
            return False
        for i, (_, r) in enumerate(queue):
            if r is request:
                self._take(request.priority, tenant_of(request), i)
                return True
        return False

    def _take(self, priority: int, tenant: str, index: int) -> Request:
        tenants = self._tiers[priority]
        _, request = tenants[tenant].pop(index)
        if not tenants[tenant]:
            del tenants[tenant]
            if not tenants:
                del self._tiers[priority]
        self._len -= 1
        self._tokens -= request.num_tokens
        return request
