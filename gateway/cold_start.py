"""Scale from zero: hold requests while no worker is ready, serve them when one turns ready.

When the driver says capacity is coming (`DriverHealth.starting`: no worker yet, a model still
loading), a request is not refused at once. It waits here, before it is
checked or tokenized (both need a worker's model), until a worker turns ready, within two bounds:

    per tier   at most `max_held[tier]` requests wait; the next one of that tier gets 503 + Retry-After
               (`NoCapacityError`, reason "hold_full") right away
    in time    a request waits at most `timeout_s`; then it gets 503 + Retry-After (reason
               "hold_timeout")

Held requests are the activation signal (`sluice_requests_held`, counted into
`vllm:num_requests_waiting`, and `sluice_desired_workers` >= 1: gateway/scaling.py): an autoscaler
that sees them starts the first worker. One poller task watches readiness while anything is held and
releases every waiter at once when a worker is ready (or ends them with 503 when the server starts
draining); when nothing is held nothing polls, and a
request that finds the driver ready passes through with one health read. A driver that is down
for another reason (an engine died and restarts, the driver stopped or gave up) is not waited for:
the request goes on and fails fast as before (503 `engine_dead`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from drivers.base import OverloadedError, ShuttingDownError


@dataclass(frozen=True)
class HoldPolicy:
    max_held: tuple[int, ...] = (64, 64, 32)
    """Requests each tier may have waiting for a first worker, tier 0 first; tiers past the last use the
    last; 0 refuses at once (SLUICE_COLD_HOLD_MAX, comma-separated)."""
    timeout_s: float = 60.0
    """Longest a request waits for a worker before 503 (SLUICE_COLD_HOLD_TIMEOUT_S). Set it to about a
    worker's cold start (image pull, weights load)."""
    poll_s: float = 0.1
    """How often readiness is read while requests are held."""

    def bound(self, tier: int) -> int:
        return self.max_held[min(max(tier, 0), len(self.max_held) - 1)]


class Readiness(enum.IntEnum):
    READY = 0  # a worker can serve now
    STARTING = 1  # none can, one is coming: hold
    DOWN = 2  # none can, none is coming: do not hold (the request fails the usual way)


class HoldOutcome(enum.StrEnum):
    SERVED = "served"  # a worker turned ready while it waited
    FULL = "hold_full"  # the tier's bound was reached: refused at once
    TIMEOUT = "hold_timeout"  # no worker within the timeout


class HoldMetrics(Protocol):
    def held(self, tier: int, outcome: HoldOutcome, waited_s: float) -> None: ...


class NoCapacityError(OverloadedError):
    """No worker is ready and this request cannot be held (bound reached) or waited too long (503 +
    Retry-After)."""

    def __init__(self, message: str, retry_after: float, outcome: HoldOutcome) -> None:
        super().__init__(message, retry_after=retry_after)
        self.outcome = outcome


class ColdStartHold:
    """Holds requests while `ready()` is False; see the module docstring."""

    def __init__(
        self, policy: HoldPolicy, ready: Callable[[], Awaitable[Readiness]], metrics: HoldMetrics | None = None
    ) -> None:
        self.policy = policy
        self._ready = ready
        self.metrics = metrics
        # The server is draining (gateway/drain.py): held requests end at once with 503 + Retry-After,
        # another replica can take them. create_app points it at the drain.
        self.stopping: Callable[[], bool] = lambda: False
        self._shutdown = False
        self.held: dict[int, int] = {}  # tier -> requests waiting now
        self._released = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None

    @property
    def total_held(self) -> int:
        return sum(self.held.values())

    async def wait(self, tier: int) -> None:
        """Return when a worker is ready (at once if one is, or if none is coming); raise NoCapacityError
        when the hold is full or the deadline passes."""
        if await self._ready() is not Readiness.STARTING:
            return
        bound = self.policy.bound(tier)
        if self.held.get(tier, 0) >= bound:
            self._record(tier, HoldOutcome.FULL, 0.0)
            raise NoCapacityError(
                f"No worker is ready and {bound} requests of priority {tier} already wait for one",
                self._retry_after(), HoldOutcome.FULL,
            )
        started = time.monotonic()
        self.held[tier] = self.held.get(tier, 0) + 1
        try:
            self._ensure_poller()
            try:
                await asyncio.wait_for(self._released.wait(), self.policy.timeout_s)
            except TimeoutError:
                self._record(tier, HoldOutcome.TIMEOUT, time.monotonic() - started)
                raise NoCapacityError(
                    f"No worker turned ready within {self.policy.timeout_s:g} s", self._retry_after(),
                    HoldOutcome.TIMEOUT,
                ) from None
            if self._shutdown:
                raise ShuttingDownError("The server is shutting down; retry the request", retry_after=1.0)
            self._record(tier, HoldOutcome.SERVED, time.monotonic() - started)
        finally:
            self.held[tier] -= 1
            if not self.held[tier]:
                del self.held[tier]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._released = asyncio.Event()  # a fresh one: the last release is over
            self._poller = asyncio.create_task(self._poll(self._released), name="sluice-cold-start-poll")

    async def _poll(self, released: asyncio.Event) -> None:
        # Runs while anything is held; a new poller (and event) starts with the next hold after it ends.
        while self.total_held:
            if self.stopping():
                self._shutdown = True
                released.set()
                return
            if await self._ready() is not Readiness.STARTING:  # ready, or nothing to wait for any more
                released.set()
                return
            await asyncio.sleep(self.policy.poll_s)

    def _retry_after(self) -> float:
        # A worker should be up within about one cold start; retrying sooner only finds the hold full again.
        return max(1.0, math.ceil(min(self.policy.timeout_s, 60.0)))

    def _record(self, tier: int, outcome: HoldOutcome, waited_s: float) -> None:
        if self.metrics is not None:
            self.metrics.held(tier, outcome, waited_s)
