"""The discrete-event model: a gateway queue in front of continuous-batching workers.

    arrival -> [no ready worker: hold (bounded per tier, deadline)] -> [shed if the estimated wait is
    past the tier's TTFT target] -> gateway queue, strict priority by tier -> least-loaded ready worker
    with a free slot and KV room -> prefill (decode pauses) -> first token -> one token per decode
    step -> finished

A worker is event-driven, not stepped: between two events (an admission, a completion) its batch does
not change, so its decode step time is constant and the next completion is `(steps left) x step`
away. Progress is a step counter: a request admitted at counter S with `output` tokens finishes when
the counter reaches S + output - 1 (its first token comes from the prefill). A day of a few million
requests thus costs a few events per request.

What the model leaves out: chunked prefill interleaving (a prefill stalls the worker's decodes for its
duration, as in an engine without chunked prefill), preemption (KV is reserved for the whole request
at admission, so a worker never runs out mid-request), prefix caching and network time.

Every `control_interval_s` the scaling policy (policies.py) is asked for a number of workers: more
are started (ready after the profile's `cold_start_s`), fewer are drained (provisioning ones cancelled
first; a drained worker takes nothing new and leaves when its requests are done). Worker-hours count
from a worker's request to its departure: booting and draining are paid for.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from scaling.desired import FleetLoad
from simulator.profile import CostProfile
from simulator.traffic import Arrivals


class ShedReason(enum.IntEnum):
    NONE = 0
    TTFT_TARGET = 1  # the estimated wait was past the tier's target on arrival
    HOLD_FULL = 2  # no ready worker and the tier's hold was full
    HOLD_TIMEOUT = 3  # held longer than the hold deadline
    NEVER_SERVED = 4  # still queued when the simulation ended


@dataclass(frozen=True)
class FleetConfig:
    ttft_targets_s: tuple[float, ...] = (2.0, 10.0, 30.0)
    shedding: bool = True
    hold_max: tuple[int, ...] = (256, 256, 128)
    hold_timeout_s: float = 300.0
    control_interval_s: float = 15.0
    rate_window_s: float = 30.0  # the fleet's token rate is measured over this window (for wait estimates)
    initial_workers: int = 1
    drain_after_s: float = 3600.0  # after the last arrival, how long queued work may still run

    def target(self, tier: int) -> float:
        return self.ttft_targets_s[min(tier, len(self.ttft_targets_s) - 1)]


class Policy(Protocol):
    name: str

    def workers(self, now: float, load: FleetLoad, current: int) -> int:
        """How many workers (booting + ready) the fleet should have now; `current` is that count."""
        ...


class _Req:
    __slots__ = ("end_step", "index", "output", "prompt", "start_step", "tier")

    def __init__(self, index: int, tier: int, prompt: int, output: int) -> None:
        self.index = index
        self.tier = tier
        self.prompt = prompt
        self.output = output
        self.start_step = 0
        self.end_step = 0


class _State(enum.IntEnum):
    BOOTING = 0
    READY = 1
    DRAINING = 2
    GONE = 3


class _Worker:
    __slots__ = (
        "ends",
        "id",
        "kv_used",
        "left_at",
        "requested_at",
        "running",
        "state",
        "step",
        "step_s",
        "sum_prompt",
        "sum_start",
        "t_ref",
        "version",
    )

    def __init__(self, wid: int, now: float) -> None:
        self.id = wid
        self.state = _State.BOOTING
        self.requested_at = now
        self.left_at: float | None = None
        self.ends: list[tuple[int, int, _Req]] = []  # (end step, index, request): the next to finish first
        self.running = 0
        self.kv_used = 0
        self.step = 0  # decode steps done
        self.t_ref = now  # time at which `step` is exact; in the future while a prefill runs
        self.step_s = 0.0
        self.sum_prompt = 0
        self.sum_start = 0
        self.version = 0  # bumps invalidate the worker's scheduled event

    def advance(self, now: float) -> None:
        if self.running and now > self.t_ref and self.step_s > 0:
            steps = int((now - self.t_ref) / self.step_s + 1e-9)
            self.step += steps
            self.t_ref += steps * self.step_s

    def context_tokens(self) -> int:
        return self.sum_prompt + self.running * self.step - self.sum_start


@dataclass
class Series:
    """The fleet over time, one row per control interval."""

    time: list[float] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)  # booting + ready + draining
    ready: list[int] = field(default_factory=list)
    target: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)


@dataclass
class Result:
    policy: str
    arrivals: Arrivals
    ttft: np.ndarray  # seconds; nan when never served
    finish: np.ndarray  # time of the last token; nan when never served
    shed: np.ndarray  # ShedReason per request
    worker_seconds: float
    series: Series
    duration_s: float


class Fleet:
    """One simulation run: `Fleet(profile, config, policy).run(arrivals)`."""

    def __init__(self, profile: CostProfile, config: FleetConfig, policy: Policy) -> None:
        self.p = profile
        self.c = config
        self.policy = policy

    def run(self, arrivals: Arrivals) -> Result:
        n = len(arrivals)
        self.ttft = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.shed = np.zeros(n, dtype=np.int8)
        self.queues: list[deque[tuple[_Req, float]]] = [deque() for _ in self.c.ttft_targets_s]
        self.queued_work = [0] * len(self.queues)  # prompt + output tokens queued per tier
        self.held = [0] * len(self.queues)
        self.workers: list[_Worker] = []  # not yet gone: booting, ready or draining
        self.departed: list[_Worker] = []
        self.ready_count = 0
        self.next_id = 0
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of completions, for the rate
        self.recent_tokens = 0
        self.prefilled: deque[tuple[float, int]] = deque()  # (time, prompt tokens) admitted, for utilization
        self.prefilled_tokens = 0
        self.series = Series()
        times, tiers = arrivals.time.tolist(), arrivals.tier.tolist()
        self._times_ref = times
        prompts, outputs = arrivals.prompt.tolist(), arrivals.output.tolist()
        end = (times[-1] if n else 0.0) + self.c.drain_after_s
        for _ in range(self.c.initial_workers):
            self._add_worker(0.0, booted=True)
        self._push(0.0, _CONTROL, None)
        i = 0
        while True:
            next_event = self.events[0][0] if self.events else math.inf
            if i < n and times[i] <= next_event:
                self._arrive(times[i], _Req(i, tiers[i], prompts[i], outputs[i]))
                i += 1
                continue
            if not self.events or next_event > end:
                break
            now, _, kind, data = heapq.heappop(self.events)
            if kind == _WORKER:
                worker: _Worker = data[0]
                version: int = data[1]
                step: int = data[2]
                if worker.version == version:
                    # Exactly the step it was scheduled for: dividing times back into steps would drift.
                    worker.step, worker.t_ref = step, max(worker.t_ref, now)
                    self._worker_event(worker, now)
            elif kind == _READY:
                self._ready(data, now)
            elif kind == _CONTROL:
                self._control(now)
                if i < n or any(self.queues) or any(w.running for w in self.workers):
                    self._push(now + self.c.control_interval_s, _CONTROL, None)
        for q in self.queues:
            for req, _ in q:
                self.shed[req.index] = ShedReason.NEVER_SERVED
        seconds = sum((w.left_at if w.left_at is not None else end) - w.requested_at
                      for w in self.workers + self.departed)
        return Result(self.policy.name, arrivals, self.ttft, self.finish, self.shed, seconds, self.series, end)

    # -- events ------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, data))

    def _arrive(self, now: float, req: _Req) -> None:
        tier = min(req.tier, len(self.queues) - 1)
        req.tier = tier
        if not self.ready_count:
            bound = self.c.hold_max[min(tier, len(self.c.hold_max) - 1)]
            if self.held[tier] >= bound:
                self.shed[req.index] = ShedReason.HOLD_FULL
                return
            self.held[tier] += 1
            self._enqueue(req, now, now + self.c.hold_timeout_s)
            return
        if self.c.shedding and self._estimated_wait(tier, now) > self.c.target(tier):
            self.shed[req.index] = ShedReason.TTFT_TARGET
            return
        self._enqueue(req, now, math.inf)
        self._dispatch(now)

    def _enqueue(self, req: _Req, now: float, deadline: float) -> None:
        self.queues[req.tier].append((req, deadline))
        self.queued_work[req.tier] += req.prompt + req.output

    def _estimated_wait(self, tier: int, now: float) -> float:
        """The shedder's estimate: work queued at tiers <= `tier` over the fleet's recent token rate,
        and at least the age of the oldest such request (what the head of the queue already waited)."""
        work = sum(self.queued_work[: tier + 1])
        if work == 0:
            return 0.0
        oldest = max((now - self._arrival_of(q[0][0]) for q in self.queues[: tier + 1] if q), default=0.0)
        rate = self._token_rate(now)
        return max(oldest, work / rate) if rate > 0 else oldest

    def _arrival_of(self, req: _Req) -> float:
        return self._times_ref[req.index]

    def _token_rate(self, now: float) -> float:
        while self.recent and self.recent[0][0] < now - self.c.rate_window_s:
            self.recent_tokens -= self.recent.popleft()[1]
        return self.recent_tokens / self.c.rate_window_s

    def _dispatch(self, now: float) -> None:
        p = self.p
        while True:
            head = None
            for q in self.queues:
                while q and q[0][1] < now:  # held past its deadline
                    req, _ = q.popleft()
                    self.queued_work[req.tier] -= req.prompt + req.output
                    self.held[req.tier] -= 1
                    self.shed[req.index] = ShedReason.HOLD_TIMEOUT
                if q:
                    head = q
                    break
            if head is None:
                return
            req = head[0][0]
            best = None
            for w in self.workers:
                if (w.state is _State.READY and w.running < p.max_num_seqs
                        and w.kv_used + req.prompt + req.output <= p.kv_tokens
                        and (best is None or w.running < best.running)):
                    best = w
            if best is None:
                return
            _, deadline = head.popleft()
            self.queued_work[req.tier] -= req.prompt + req.output
            if deadline != math.inf:  # it was held for a first worker
                self.held[req.tier] -= 1
            self._admit(best, req, now)

    def _admit(self, w: _Worker, req: _Req, now: float) -> None:
        w.advance(now)
        start = max(now, w.t_ref)
        first = start + self.p.prefill_s(req.prompt)
        w.t_ref = first  # decodes pause while the prompt is computed
        self.ttft[req.index] = first - self._times_ref[req.index]
        req.start_step = w.step
        req.end_step = w.step + req.output - 1
        w.running += 1
        w.kv_used += req.prompt + req.output
        w.sum_prompt += req.prompt
        w.sum_start += req.start_step
        heapq.heappush(w.ends, (req.end_step, req.index, req))
        self.prefilled.append((now, req.prompt))
        self.prefilled_tokens += req.prompt
        self._reschedule(w)

    def _reschedule(self, w: _Worker) -> None:
        w.version += 1
        if not w.running:
            if w.state is _State.DRAINING:
                self._depart(w, max(w.t_ref, self._now_hint))
            return
        w.step_s = self.p.decode_step_s(w.running, w.context_tokens())
        target = w.ends[0][0]
        self._push(w.t_ref + (target - w.step) * w.step_s, _WORKER, (w, w.version, target))

    def _worker_event(self, w: _Worker, now: float) -> None:
        self._now_hint = now
        tokens = 0
        while w.ends and w.ends[0][0] <= w.step:
            _, _, req = heapq.heappop(w.ends)
            self.finish[req.index] = now
            w.running -= 1
            w.kv_used -= req.prompt + req.output
            w.sum_prompt -= req.prompt
            w.sum_start -= req.start_step
            tokens += req.prompt + req.output
        if tokens:
            self.recent.append((now, tokens))
            self.recent_tokens += tokens
        self._reschedule(w)
        self._dispatch(now)

    def _ready(self, w: _Worker, now: float) -> None:
        if w.state is _State.BOOTING:
            w.state = _State.READY
            self.ready_count += 1
            w.t_ref = now
            self._dispatch(now)

    def _depart(self, w: _Worker, now: float) -> None:
        w.state, w.left_at = _State.GONE, now
        self.workers.remove(w)
        self.departed.append(w)

    # -- scaling -----------------------------------------------------------------------------

    def _add_worker(self, now: float, booted: bool = False) -> None:
        self.next_id += 1
        w = _Worker(self.next_id, now)
        self.workers.append(w)
        if booted:
            w.state = _State.READY
            self.ready_count += 1
        else:
            self._push(now + self.p.cold_start_s, _READY, w)

    def _prefill_utilization(self, now: float, ready: int) -> float | None:
        """Prompt tokens admitted per second over the ready workers' prefill rate (the gateway's
        prompt_tokens_per_s / prefill_tokens_per_s)."""
        while self.prefilled and self.prefilled[0][0] < now - self.c.rate_window_s:
            self.prefilled_tokens -= self.prefilled.popleft()[1]
        if not ready or math.isinf(self.p.prefill_tokens_per_s):
            return None
        return self.prefilled_tokens / self.c.rate_window_s / (ready * self.p.prefill_tokens_per_s)

    def load(self, now: float) -> FleetLoad:
        ready = [w for w in self.workers if w.state is _State.READY]
        waits = {t: self._estimated_wait(t, now) for t in range(len(self.queues))} if ready else {}
        return FleetLoad(
            ready_workers=len(ready), wait_s_by_tier=waits, running=sum(w.running for w in ready),
            waiting=sum(len(q) for q in self.queues) - sum(self.held), held=sum(self.held),
            max_num_seqs=self.p.max_num_seqs * len(ready), kv_blocks_used=sum(w.kv_used for w in ready),
            kv_blocks_total=self.p.kv_tokens * len(ready),
            prefill_utilization=self._prefill_utilization(now, len(ready)),
        )

    def _control(self, now: float) -> None:
        self._now_hint = now
        active = [w for w in self.workers if w.state in (_State.BOOTING, _State.READY)]
        load = self.load(now)
        target = max(0, self.policy.workers(now, load, len(active)))
        if target > len(active):
            for _ in range(target - len(active)):
                self._add_worker(now)
        elif target < len(active):
            surplus = len(active) - target
            # Cancel booting workers first (newest first), then drain the least loaded ready ones.
            for w in sorted(active, key=lambda w: (w.state is _State.READY, w.running, -w.requested_at)):
                if surplus == 0:
                    break
                surplus -= 1
                if w.state is _State.BOOTING:
                    self._depart(w, now)
                else:
                    w.state = _State.DRAINING
                    self.ready_count -= 1
                    w.advance(now)
                    self._reschedule(w)
        s = self.series
        s.time.append(now)
        s.workers.append(len(self.workers))
        s.ready.append(load.ready_workers)
        s.target.append(target)
        s.queued.append(sum(len(q) for q in self.queues))

    _times_ref: list[float]
    _now_hint: float = 0.0


_WORKER, _READY, _CONTROL = 0, 1, 2


def simulate(profile: CostProfile, config: FleetConfig, policy: Policy, arrivals: Arrivals) -> Result:
    return Fleet(profile, config, policy).run(arrivals)
