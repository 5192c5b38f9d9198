"""Admission control: refuse early (503 + Retry-After) what the engine cannot serve in time.

Before a request is dispatched, the gateway predicts its time to first token and, where the request
would wait for a running slot, refuses it when the work ahead of it misses the TTFT target of its
priority tier (below). A request's first token waits on one of two things:

  * prompts ahead of it (prefill-bound, the usual case below the running cap): its own prompt and
    every prompt token not yet served of requests at priority <= p, at the rate prompt tokens were
    served while such work was queued (`DriverHealth.prefill_tokens_per_s`):

        prefill(p) = (running prefill left + queued prompt tokens of priority <= p + own prompt)
                     / prefill rate

    Queued requests' *decodes* are not ahead of it: they run batched beside its prefill.
  * a running slot (slot-bound: the engine is at its running cap or out of KV blocks): slots free
    as running requests finish, so everything queued ahead must largely run first:

        slots(p) = (prompt + max_tokens left of queued requests of priority <= p)
                   / (prompt tokens served + generation tokens per second)

    "Ahead" is the larger of the engine's figures (up to ~0.1 s old) and this gateway's own count
    of what it sent that has no first token yet (exact, never stale).

    predicted(p) = calibration x max(prefill(p), slots(p) when slot-bound)

Work and rates are in one unit, prompt tokens *served*: whole prompts, whether the engine computes
them or finds part of them in its prefix cache. What is queued is counted whole (this gateway cannot
know a prompt's cache hits, nor can the engine before it admits the request), so the engine's rates
count the cached tokens it served too, and the recent hit ratio is folded into the rate. (Rates of
computed tokens alone made prompts sharing a 1,000-token cached prefix look 15x longer than they were,
beyond what calibration can absorb, and a load the engine served was refused.) The estimate assumes
the queued prompts hit the cache as the recent ones did; calibration corrects the rest.

`calibration` is learned: when an admitted request's first token comes, the TTFT it really had is
compared with the prediction made when it was admitted, and the factor follows the ratio (a slow
moving average, bounded to [1/4, 4]). Until `trust_after` first tokens have been checked so, the
estimate is unproven and refuses only what even its most optimistic reading (1/4 of it) misses: on a
fresh server the first rates are measured on a cold prefix cache, and prompts sharing a 1,000-token
system prompt looked 10x longer than they then were (a load the server served was refused 50 times in
64 before one admitted request could correct it). Both the ratio (`sluice_ttft_prediction_ratio`) and every
refusal with its reason (`sluice_shed_requests_total`) are exported, so what the estimate says
can be checked against what happened.

What the estimate refuses, and what it does not. Shedding is for loads the server cannot serve, and
a load it cannot serve shows as requests waiting for a running slot: below the running cap every
request joins the batch at once, and what is ahead of its first token is bounded by the cap (a steady
closed-loop load of 32 streams at a cap of 64 is served, however long its prompts; refusing such
requests made a servable load fail, issue 10). So the TTFT target refuses a request only when it would
queue for a slot (the engine at its running cap or out of KV blocks by its figures, or this gateway's
own requests in flight, or the engine's running and waiting ones, already at the cap), and only on the
wait for the work *ahead* of it: its own prompt's time is no wait, and a retry could never cut it (a
lone long prompt on an idle server was refused before). The estimate itself still includes the own
prompt: it is what the first token takes, and what calibration is checked against.

The queue is strict priority, so only work of priority <= p is ahead of a request of priority p.
On top of the estimate, every tier may fill only its share of the waiting queue's bounds
(`queue_share`, requests and tokens), so a burst that arrives before any throughput is measured
(an idle engine) still leaves room to higher tiers. The engine's own bounds (`max_waiting`,
`max_waiting_tokens`) stay the last line: the driver turns a full queue into the same error.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from drivers.base import DriverHealth, OverloadedError

MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class SheddingPolicy:
    """Per-tier targets; tier i uses entry i, tiers beyond the last use the last entry."""

    ttft_targets_s: tuple[float, ...] = (2.0, 10.0, 30.0)
    # Fraction of the waiting queue's bounds (requests and tokens) requests of a tier may fill.
    queue_share: tuple[float, ...] = (1.0, 0.9, 0.75)
    enabled: bool = True
    # First tokens checked against the TTFT estimate before it refuses at its face value; before that
    # it refuses only when a quarter of it (the calibration's lower bound) misses the target.
    trust_after: int = 4

    def target(self, priority: int) -> float:
        return _tier(self.ttft_targets_s, priority)

    def share(self, priority: int) -> float:
        return _tier(self.queue_share, priority)


def _tier(values: tuple[float, ...], priority: int) -> float:
    return values[min(max(priority, 0), len(values) - 1)]


@dataclass(frozen=True)
class Estimate:
    """What the shedder believes about the queue a request of one priority would join."""

    wait_s: float | None  # predicted time to first token (calibrated); None: nothing measured yet
    waiting: int  # requests queued (all tiers), including those sent since the engine's figures
    waiting_tokens: int
    predicted_s: float | None = None  # the same before calibration, what the calibration learns from
    # The part of predicted_s spent on work ahead of the request (its own prompt's time left out).
    predicted_ahead_s: float | None = None
    queues_for_slot: bool = False  # it would wait for a running slot: the TTFT target may refuse it


class ShedReason(enum.StrEnum):
    TTFT_TARGET = "ttft_target"  # queued for a slot behind more work than the tier's TTFT target
    QUEUE_SHARE = "queue_share"  # the tier's share of the waiting queue (requests) is full
    QUEUE_TOKENS = "queue_tokens"  # the tier's share of the waiting queue (tokens) is full


class SheddingMetrics(Protocol):
    def shed(self, priority: int, reason: ShedReason) -> None: ...

    def ttft_prediction(self, actual_over_predicted: float) -> None: ...


class Pending:
    """A request this gateway sent: queued until `started()` (first token), in flight until `finished()`."""

    __slots__ = ("admitted_at", "calibration", "finished", "predicted_s", "priority", "prompt_tokens",
                 "started", "work")

    def __init__(self, priority: int, work: int, prompt_tokens: int, admitted_at: float,
                 predicted_s: float | None, calibration: float) -> None:
        self.priority = priority
        self.work = work  # prompt + max_tokens
        self.prompt_tokens = prompt_tokens
        self.admitted_at = admitted_at
        self.predicted_s = predicted_s  # uncalibrated prediction of its TTFT, None when there was none
        self.calibration = calibration  # the factor applied to it when it was admitted
        self.started = False
        self.finished = False


# Predictions shorter than this are mostly noise (a step, a stats tick): they do not teach calibration.
MIN_CALIBRATION_S = 0.25
CALIBRATION_BOUNDS = (0.25, 4.0)
CALIBRATION_WEIGHT = 0.1  # weight of each new observation in the moving average


class LoadShedder:
    """Decides admit or refuse from the driver's health and the requests this gateway has in flight."""

    def __init__(
        self,
        policy: SheddingPolicy,
        metrics: SheddingMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        # priority -> [requests, work tokens, prompt tokens] sent and without a first token yet.
        self._unstarted: dict[int, list[int]] = {}
        self.in_flight = 0  # sent and not finished
        self.shed_total: dict[int, int] = {}  # priority -> requests refused, since start
        self.calibration = 1.0  # actual TTFT / predicted TTFT, learned
        self.checked = 0  # predictions checked against a real first token

    def estimate(self, health: DriverHealth, priority: int, prompt_tokens: int = 0) -> Estimate:
        """The predicted TTFT of a request of `priority` with `prompt_tokens` sent now."""
        unstarted = sum(q[0] for q in self._unstarted.values())
        # In flight beyond the running cap are queued (this gateway's view, never stale); the queued ones
        # are among those without a first token, so that share of their work and tokens is queued.
        cap = health.max_num_seqs or health.running
        queued_here = min(unstarted, max(0, self.in_flight - cap))
        share = queued_here / unstarted if unstarted else 0.0
        waiting = max(health.waiting, queued_here)
        waiting_tokens = max(
            health.waiting_tokens, round(share * sum(q[2] for q in self._unstarted.values()))
        )
        rate = health.prefill_tokens_per_s
        prompts_ahead = self._prompts_ahead(health, priority)
        slots = self._slot_bound(health, priority, share)
        predicted = _max_known(_at_rate(prompts_ahead + prompt_tokens, rate), slots)
        predicted_ahead = _max_known(_at_rate(prompts_ahead, rate), slots)
        wait = None if predicted is None else predicted * self.calibration
        return Estimate(wait, waiting, waiting_tokens, predicted, predicted_ahead, self._queues_for_slot(health))

    def _queues_for_slot(self, health: DriverHealth) -> bool:
        """Whether a request sent now would wait for a running slot (or KV blocks) rather than join the batch."""
        if not health.max_num_seqs:
            return True  # a driver that names no cap: assume the worst, as before this rule
        in_engine = max(self.in_flight, health.running + health.waiting)
        return _kv_full(health) or in_engine >= health.max_num_seqs

    def _prompts_ahead(self, health: DriverHealth, priority: int) -> int:
        """Prompt tokens to be served before a newcomer's of `priority`."""
        # Every request of ours without a first token still has (some of) its prompt to compute.
        local = sum(q[2] for p, q in self._unstarted.items() if p <= priority)
        engine = health.prefill_running + sum(
            w for p, w in health.prefill_waiting_by_priority.items() if p <= priority
        )
        return max(local, engine)

    def _slot_bound(self, health: DriverHealth, priority: int, share: float) -> float | None:
        # Throughput measures capacity only while the engine is saturated; a lightly loaded engine's says
        # how much was asked of it, and would make every wait look long.
        saturated = 0 < health.max_num_seqs <= health.running or _kv_full(health)
        if not saturated:
            return None  # below the cap queued requests wait on prefill (above), not on slots
        local_work = share * sum(q[1] for p, q in self._unstarted.items() if p <= priority)
        engine_work = sum(w for p, w in health.waiting_work_by_priority.items() if p <= priority)
        work = max(local_work, engine_work)
        if work == 0:
            return 0.0
        rate = health.prompt_tokens_per_s + health.generation_tokens_per_s
        return work / rate if rate > 0 else None

    def admit(self, health: DriverHealth, priority: int, prompt_tokens: int, max_tokens: int) -> Pending:
        """Count the request as sent, or raise OverloadedError (503 + Retry-After)."""
        est = self.estimate(health, priority, prompt_tokens)
        if self.policy.enabled:
            self._check(health, est, priority, prompt_tokens)
        pending = Pending(priority, prompt_tokens + max_tokens, prompt_tokens, self.clock(), est.predicted_s,
                          self.calibration)
        q = self._unstarted.setdefault(priority, [0, 0, 0])
        q[0] += 1
        q[1] += pending.work
        q[2] += prompt_tokens
        self.in_flight += 1
        return pending

    def started(self, pending: Pending) -> None:
        """The request's first token came: it no longer waits; its real TTFT teaches the calibration.
        Idempotent."""
        if pending.started:
            return
        pending.started = True
        q = self._unstarted[pending.priority]
        q[0] -= 1
        q[1] -= pending.work
        q[2] -= pending.prompt_tokens
        if q[0] == 0:
            del self._unstarted[pending.priority]
        if pending.predicted_s is not None and pending.predicted_s >= MIN_CALIBRATION_S:
            actual = self.clock() - pending.admitted_at
            ratio = actual / pending.predicted_s
            low, high = CALIBRATION_BOUNDS
            learned = (1 - CALIBRATION_WEIGHT) * self.calibration + CALIBRATION_WEIGHT * ratio
            self.calibration = min(high, max(low, learned))
            self.checked += 1
            if self.metrics is not None:
                self.metrics.ttft_prediction(actual / (pending.predicted_s * pending.calibration))

    def finished(self, pending: Pending) -> None:
        """The request ended, however it ended. Idempotent."""
        if not pending.started:  # ended without a first token: nothing to learn from it
            pending.predicted_s = None
            self.started(pending)
        if not pending.finished:
            pending.finished = True
            self.in_flight -= 1

    def _check(self, health: DriverHealth, est: Estimate, priority: int, prompt_tokens: int) -> None:
        target = self.policy.target(priority)
        ahead = est.predicted_ahead_s
        if ahead is not None:  # calibrated once proven; until then its most optimistic reading
            ahead *= self.calibration if self.checked >= self.policy.trust_after else CALIBRATION_BOUNDS[0]
        if est.queues_for_slot and ahead is not None and ahead > target:
            self._refuse(
                priority,
                ShedReason.TTFT_TARGET,
                f"No running slot is free and the work ahead would delay the first token {ahead:.1f} s, "
                f"beyond the {target:g} s target of priority {priority}",
                ahead - target,
            )
        share = self.policy.share(priority)
        retry = est.wait_s if est.wait_s else 1.0
        # Rounded: in a queue of 2, a 0.9 share is both places, not one.
        if health.max_waiting and est.waiting + 1 > round(share * health.max_waiting):
            self._refuse(
                priority,
                ShedReason.QUEUE_SHARE,
                f"The waiting queue is full for priority {priority} ({est.waiting} of "
                f"{round(share * health.max_waiting)} requests)",
                retry,
            )
        if (
            health.max_waiting_tokens
            and est.waiting
            and est.waiting_tokens + prompt_tokens > share * health.max_waiting_tokens
        ):
            self._refuse(
                priority,
                ShedReason.QUEUE_TOKENS,
                f"The waiting queue is full for priority {priority} ({est.waiting_tokens} + {prompt_tokens} "
                f"of {share * health.max_waiting_tokens:.0f} tokens)",
                retry,
            )

    def _refuse(self, priority: int, reason: ShedReason, message: str, retry_after_s: float) -> None:
        self.shed_total[priority] = self.shed_total.get(priority, 0) + 1
        if self.metrics is not None:
            self.metrics.shed(priority, reason)
        retry = min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(retry_after_s)))
        raise ShedError(message, retry_after=retry, reason=reason)


class ShedError(OverloadedError):
    """Refused by admission control (503 + Retry-After); `reason` says which check."""

    def __init__(self, message: str, retry_after: float, reason: ShedReason) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason


def _kv_full(health: DriverHealth) -> bool:
    return health.kv_blocks_total > 0 and health.kv_blocks_used >= 0.95 * health.kv_blocks_total


def _at_rate(tokens: int, tokens_per_s: float) -> float | None:
    if tokens == 0:
        return 0.0
    return tokens / tokens_per_s if tokens_per_s > 0 else None


def _max_known(*values: float | None) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None
