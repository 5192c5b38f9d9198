"""Admission control: refuse early (503 + Retry-After) what the engine cannot serve in time.

Before a request is dispatched, the gateway estimates how long it would wait in the
engine's queue and compares that with the TTFT target of its priority tier:

    work_ahead(p) = tokens still to compute (prompt left + max_tokens left) of the requests queued
                    with priority <= p: the larger of the engine's figure
                    (`DriverHealth.waiting_work_by_priority`, up to ~0.1 s old) and this gateway's own
                    count of requests it sent and that are past the running cap (exact, never stale)
    wait(p)       = work_ahead(p) / (prompt + generation tokens per second, recently, measured
                                     while the engine was saturated; otherwise no estimate)

The queue is strict priority, so only work of priority <= p is ahead of a request of
priority p. Under overload the work piles up behind the lowest tier: wait(2) grows with
everything queued while wait(0) grows only with tier-0 work, so tier 2 misses its (looser)
target long before tier 0 misses its own. On top of the estimate, every tier may fill only
its share of the waiting queue's bounds (`queue_share`, requests and tokens), so a burst that
arrives before any throughput is measured (an idle engine) still leaves room to higher tiers.
The engine's own bounds (`max_waiting`, `max_waiting_tokens`) stay the last line: the driver
turns a full queue into the same OverloadedError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from drivers.base import DriverHealth, OverloadedError

MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class SheddingPolicy:
    """Per-tier targets; tier i uses entry i, tiers beyond the last use the last entry."""

    ttft_targets_s: tuple[float, ...] = (2.0, 10.0, 30.0)
    # Fraction of the waiting queue's bounds (requests and tokens) requests of a tier may fill.
    queue_share: tuple[float, ...] = (1.0, 0.9, 0.75)
    enabled: bool = True

    def target(self, priority: int) -> float:
        return _tier(self.ttft_targets_s, priority)

    def share(self, priority: int) -> float:
        return _tier(self.queue_share, priority)


def _tier(values: tuple[float, ...], priority: int) -> float:
    return values[min(max(priority, 0), len(values) - 1)]


@dataclass(frozen=True)
class Estimate:
    """What the shedder believes about the queue a request of one priority would join."""

    wait_s: float | None  # None: no throughput measured yet, so no estimate
    waiting: int  # requests queued (all tiers), including those sent since the engine's figures
    waiting_tokens: int


class Pending:
    """A request this gateway sent: queued until `started()` (first token), in flight until `finished()`."""

    __slots__ = ("finished", "priority", "prompt_tokens", "started", "work")

    def __init__(self, priority: int, work: int, prompt_tokens: int) -> None:
        self.priority = priority
        self.work = work  # prompt + max_tokens
        self.prompt_tokens = prompt_tokens
        self.started = False
        self.finished = False


class LoadShedder:
    """Decides admit or refuse from the driver's health and the requests this gateway has in flight."""

    def __init__(self, policy: SheddingPolicy) -> None:
        self.policy = policy
        # priority -> [requests, work tokens, prompt tokens] sent and without a first token yet.
        self._unstarted: dict[int, list[int]] = {}
        self.in_flight = 0  # sent and not finished
        self.shed_total: dict[int, int] = {}  # priority -> requests refused, since start

    def estimate(self, health: DriverHealth, priority: int) -> Estimate:
        unstarted = sum(q[0] for q in self._unstarted.values())
        # In flight beyond the running cap are queued (this gateway's view, never stale); the queued ones
        # are among those without a first token, so that share of their work and tokens is queued.
        cap = health.max_num_seqs or health.running
        queued_here = min(unstarted, max(0, self.in_flight - cap))
        share = queued_here / unstarted if unstarted else 0.0
        local_work = share * sum(q[1] for p, q in self._unstarted.items() if p <= priority)
        engine_work = sum(w for p, w in health.waiting_work_by_priority.items() if p <= priority)
        work = max(local_work, engine_work)
        waiting = max(health.waiting, queued_here)
        waiting_tokens = max(
            health.waiting_tokens, round(share * sum(q[2] for q in self._unstarted.values()))
        )
        # Throughput measures capacity only while the engine is saturated; a lightly loaded engine's says
        # how much was asked of it, and would make every wait look long.
        saturated = health.waiting > 0 or 0 < health.max_num_seqs <= health.running
        rate = health.prompt_tokens_per_s + health.generation_tokens_per_s if saturated else 0.0
        wait = work / rate if rate > 0 else (0.0 if work == 0 else None)
        return Estimate(wait, waiting, waiting_tokens)

    def admit(self, health: DriverHealth, priority: int, prompt_tokens: int, max_tokens: int) -> Pending:
        """Count the request as sent, or raise OverloadedError (503 + Retry-After)."""
        if self.policy.enabled:
            self._check(health, priority, prompt_tokens)
        pending = Pending(priority, prompt_tokens + max_tokens, prompt_tokens)
        q = self._unstarted.setdefault(priority, [0, 0, 0])
        q[0] += 1
        q[1] += pending.work
        q[2] += prompt_tokens
        self.in_flight += 1
        return pending

    def started(self, pending: Pending) -> None:
        """The request's first token came: it no longer waits. Idempotent."""
        if pending.started:
            return
        pending.started = True
        q = self._unstarted[pending.priority]
        q[0] -= 1
        q[1] -= pending.work
        q[2] -= pending.prompt_tokens
        if q[0] == 0:
            del self._unstarted[pending.priority]

    def finished(self, pending: Pending) -> None:
        """The request ended, however it ended. Idempotent."""
        self.started(pending)
        if not pending.finished:
            pending.finished = True
            self.in_flight -= 1

    def _check(self, health: DriverHealth, priority: int, prompt_tokens: int) -> None:
        est = self.estimate(health, priority)
        target = self.policy.target(priority)
        if est.wait_s is not None and est.wait_s > target:
            self._refuse(
                priority,
                f"Estimated queue wait {est.wait_s:.1f} s exceeds the {target:g} s target of priority {priority}",
                est.wait_s - target,
            )
        share = self.policy.share(priority)
        retry = est.wait_s if est.wait_s else 1.0
        if health.max_waiting and est.waiting + 1 > share * health.max_waiting:
            self._refuse(
                priority,
                f"The waiting queue is full for priority {priority} ({est.waiting} of "
                f"{share * health.max_waiting:.0f} requests)",
                retry,
            )
        if (
            health.max_waiting_tokens
            and est.waiting
            and est.waiting_tokens + prompt_tokens > share * health.max_waiting_tokens
        ):
            self._refuse(
                priority,
                f"The waiting queue is full for priority {priority} ({est.waiting_tokens} + {prompt_tokens} "
                f"of {share * health.max_waiting_tokens:.0f} tokens)",
                retry,
            )

    def _refuse(self, priority: int, message: str, retry_after_s: float) -> None:
        self.shed_total[priority] = self.shed_total.get(priority, 0) + 1
        retry = min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(retry_after_s)))
        raise OverloadedError(message, retry_after=retry)
