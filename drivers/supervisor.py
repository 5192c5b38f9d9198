"""Engine supervision: a dead engine is restarted with backoff; a crash loop is given up on.

One task watches each engine:

    running --(dies)--> restarting --(backoff, then a fresh process loaded)--> running
                          |    ^ (the fresh process fails to start: one more death)
                          |    |
                          +----+--(max_failures deaths within failure_window_s)--> failed, for good

The backoff doubles from `backoff_initial_s` up to `backoff_max_s`; an engine that stayed up for
`backoff_reset_after_s` before it died starts again from the initial delay. The decisions are
pure (`RestartBudget`, fed readings of a clock), so tests drive them with an injected clock.

Requests on an engine that dies end at once with the engine's typed error (the client fails its
streams); the supervisor only brings the process back. Liveness is its verdict: once it gave up on
any engine, `gave_up` is non-empty and the gateway's /healthz answers 503, so that an orchestrator
restarts the whole process. Readiness (some engine can serve now) is the driver's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("sluice.supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 1.0
    """Wait before the first restart after a death (SLUICE_ENGINE_RESTART_BACKOFF_S)."""
    backoff_max_s: float = 30.0
    """Cap of the doubling wait between restarts."""
    backoff_reset_after_s: float = 60.0
    """An engine up this long before it died restarts after the initial wait again."""
    max_failures: int = 5
    """Deaths (including failed starts) within `failure_window_s` that make a crash loop: the
    supervisor gives up and liveness fails (SLUICE_ENGINE_MAX_FAILURES)."""
    failure_window_s: float = 300.0
    """The crash-loop window (SLUICE_ENGINE_FAILURE_WINDOW_S)."""

    def __post_init__(self) -> None:
        if self.max_failures < 1 or self.failure_window_s <= 0:
            raise ValueError("max_failures must be >= 1 and failure_window_s > 0")
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("the restart backoff needs 0 <= backoff_initial_s <= backoff_max_s")


class RestartBudget:
    """The restart decisions of one engine: how long to wait, or to give up."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.failures: deque[float] = deque()  # times of the deaths within the window
        self.consecutive = 0  # restarts since the engine last stayed up for backoff_reset_after_s

    def on_failure(self, now: float, up_since: float | None) -> float | None:
        """Record a death at `now` of an engine up since `up_since` (None: it never came up).
        Returns the wait before the next restart, or None: a crash loop, give up."""
        p = self.policy
        if up_since is not None and now - up_since >= p.backoff_reset_after_s:
            self.consecutive = 0
        self.failures.append(now)
        while self.failures and self.failures[0] <= now - p.failure_window_s:
            self.failures.popleft()
        if len(self.failures) >= p.max_failures:
            return None
        delay = min(p.backoff_initial_s * 2.0**self.consecutive, p.backoff_max_s)
        self.consecutive += 1
        return delay


class EngineState(enum.StrEnum):
    RUNNING = "running"
    RESTARTING = "restarting"
    FAILED = "failed"  # given up on: a crash loop


class SupervisedEngine(Protocol):
    """What the supervisor needs of an engine (a local engine process today, a worker tomorrow)."""

    @property
    def node_id(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    async def wait_dead(self) -> str:
        """Return once the engine is dead (at once if it is), with why."""
        ...

    async def restart(self) -> None:
        """Bring up a fresh engine in place of the dead one; raises if it fails to start."""
        ...


class SupervisorListener(Protocol):
    """Told about every transition (the node router keeps node health and /admin/nodes from it)."""

    def engine_died(self, node: str, reason: str, restart_in_s: float | None) -> None:
        """`restart_in_s` None: the supervisor gave up on it."""

    def engine_restarted(self, node: str) -> None: ...


@dataclass
class EngineRecord:
    """What the supervisor knows of one engine."""

    budget: RestartBudget
    state: EngineState = EngineState.RUNNING
    up_since: float | None = None
    restarts: int = 0  # successful restarts
    failures: int = 0  # deaths, failed starts included
    last_failure: str | None = None
    restart_at: float | None = None  # clock reading of the next attempt while restarting

    def describe(self, now: float) -> str:
        if self.state is EngineState.RUNNING:
            return f"running (restarts: {self.restarts})"
        if self.state is EngineState.FAILED:
            return f"failed for good after {self.failures} deaths (last: {self.last_failure})"
        wait = max(0.0, (self.restart_at or now) - now)
        return f"restarting in {wait:.1f} s (after: {self.last_failure})"


class EngineSupervisor:
    def __init__(
        self,
        engines: Sequence[SupervisedEngine],
        policy: RestartPolicy | None = None,
        listener: SupervisorListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines = list(engines)
        self._by_node = {e.node_id: e for e in self.engines}
        self.policy = policy or RestartPolicy()
        self.listener = listener
        self.clock = clock
        now = clock()
        self.records = {
            e.node_id: EngineRecord(RestartBudget(self.policy), up_since=now) for e in self.engines
        }
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(e), name=f"sluice-supervise-{e.node_id}") for e in self.engines
        ]

    async def stop(self) -> None:
        """Stop watching (before the engines are shut down on purpose, so none is restarted)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    @property
    def gave_up(self) -> list[str]:
        return [node for node, r in self.records.items() if r.state is EngineState.FAILED]

    def describe(self, node: str) -> str:
        record = self.records[node]
        # A watcher takes a moment to see its engine die; until then the record still says running,
        # and the truth is that a restart is coming.
        if record.state is EngineState.RUNNING and not self._by_node[node].alive:
            return "died; restarting"
        return record.describe(self.clock())

    async def _watch(self, engine: SupervisedEngine) -> None:
        node = engine.node_id
        record = self.records[node]
        while True:
            reason = await engine.wait_dead()
            now = self.clock()
            record.failures += 1
            record.last_failure = reason
            delay = record.budget.on_failure(now, record.up_since)
            record.up_since = None
            if delay is None:
                record.state, record.restart_at = EngineState.FAILED, None
                log.error("engine crash loop: giving up", extra={
                    "node": node, "reason": reason, "failures": len(record.budget.failures),
                    "window_s": self.policy.failure_window_s,
                })
                if self.listener is not None:
                    self.listener.engine_died(node, reason, None)
                return
            record.state, record.restart_at = EngineState.RESTARTING, now + delay
            log.warning("engine died; restarting", extra={"node": node, "reason": reason, "restart_in_s": delay})
            if self.listener is not None:
                self.listener.engine_died(node, reason, delay)
            await asyncio.sleep(delay)
            try:
                await engine.restart()
            except Exception as exc:  # noqa: BLE001 - a failed start is one more death; wait_dead returns at once
                log.error("engine restart failed", extra={"node": node, "error": str(exc)})
                continue
            record.state, record.restart_at, record.up_since = EngineState.RUNNING, None, self.clock()
            record.restarts += 1
            log.warning("engine restarted", extra={"node": node, "restarts": record.restarts})
            if self.listener is not None:
                self.listener.engine_restarted(node)
