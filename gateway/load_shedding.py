"""Admission control: refuse early (503 + Retry-After) what the engine cannot serve in time.

Before a request is dispatched, the gateway estimates how long it would wait in the
engine's queue and compares that with the TTFT target of its priority tier:

    work_ahead(p) = tokens still to compute (prompt left + max_tokens left) of the requests queued
                    with priority <= p: the larger of the engine's figure
                    (`DriverHealth.waiting_work_by_priority`, up to ~0.1 s old) and this gateway's own
                    count of requests it sent that have no first token yet (exact, never stale)
    wait(p)       = work_ahead(p) / (prompt + generation tokens per second, recently)

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
    """A request this gateway sent that has no first token yet; `started()` it exactly once."""

    __slots__ = ("done", "priority", "prompt_tokens", "work")

    def __init__(self, priority: int, work: int, prompt_tokens: int) -> None:
        self.priority = priority
        self.work = work  # prompt + max_tokens
        self.prompt_tokens = prompt_tokens
        self.done = False


class LoadShedder:
    """Decides admit or refuse from the driver's health and the requests this gateway has queued."""

    def __init__(self, policy: SheddingPolicy) -> None:
        self.policy = policy
        # priority -> [requests, work tokens, prompt tokens] sent and not started; a few ints per tier.
        self._queued: dict[int, list[int]] = {}
        self.shed_total: dict[int, int] = {}  # priority -> requests refused, since start

    def estimate(self, health: DriverHealth, priority: int) -> Estimate:
        local_work = sum(q[1] for p, q in self._queued.items() if p <= priority)
        engine_work = sum(w for p, w in health.waiting_work_by_priority.items() if p <= priority)
        work = max(local_work, engine_work)
        local_count = sum(q[0] for q in self._queued.values())
        local_tokens = sum(q[2] for q in self._queued.values())
        # Of the requests sent and not started, those that fit free running slots are not queued.
        free_slots = max(0, health.max_num_seqs - health.running) if health.max_num_seqs else 0
        waiting = max(health.waiting, local_count - free_slots)
        waiting_tokens = max(health.waiting_tokens, local_tokens if local_count > free_slots else 0)
        rate = health.prompt_tokens_per_s + health.generation_tokens_per_s
        wait = work / rate if rate > 0 else (0.0 if work == 0 else None)
        return Estimate(wait, waiting, waiting_tokens)

    def admit(self, health: DriverHealth, priority: int, prompt_tokens: int, max_tokens: int) -> Pending:
        """Count the request as queued, or raise OverloadedError (503 + Retry-After)."""
        if self.policy.enabled:
            self._check(health, priority, prompt_tokens)
        pending = Pending(priority, prompt_tokens + max_tokens, prompt_tokens)
        q = self._queued.setdefault(priority, [0, 0, 0])
        q[0] += 1
        q[1] += pending.work
        q[2] += prompt_tokens
        return pending

    def started(self, pending: Pending) -> None:
        """The request's first token came (or it failed): it no longer waits. Idempotent."""
        if pending.done:
            return
        pending.done = True
        q = self._queued[pending.priority]
        q[0] -= 1
        q[1] -= pending.work
        q[2] -= pending.prompt_tokens
        if q[0] == 0:
            del self._queued[pending.priority]

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
