"""Closed forms the simulator is checked against."""

from __future__ import annotations

import math


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue (`offered_load` = lambda / mu < servers)."""
    if not 0 <= offered_load < servers:
        raise ValueError("offered load must lie in [0, servers)")
    term, total = 1.0, 1.0  # a^k / k!, summed for k < c
    for k in range(1, servers):
        term *= offered_load / k
        total += term
    last = term * offered_load / servers  # a^c / c!
    tail = last * servers / (servers - offered_load)
    return tail / (total + tail)


def mmc_mean_wait(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean time in queue (before service starts) of M/M/c: C(c, a) / (c mu - lambda)."""
    a = arrival_rate / service_rate
    return erlang_c(servers, a) / (servers * service_rate - arrival_rate) if a < servers else math.inf


def fcfs_waits(arrivals: list[float], services: list[float], servers: int) -> list[float]:
    """Exact waits of a first-come-first-served queue with `servers` identical servers, for one sample
    path: each arrival starts when it comes or when the earliest server frees, whichever is later."""
    import heapq

    free = [0.0] * servers
    waits = []
    for arrival, service in zip(arrivals, services, strict=True):
        start = max(arrival, heapq.heappop(free))
        waits.append(start - arrival)
        heapq.heappush(free, start + service)
    return waits
