"""Releases a shared backend could not take, retried in the background until they land or their lease ends.

A lost release holds its concurrency slots and tokens until its lease runs out:
with a tenant at its cap, that is a 429 on every request for a whole lease. So
a release that fails (Redis away, a timeout) is kept here and retried, oldest
first, with a backoff; one failure ends a round, so an outage costs one call per
backoff step, not one per waiting release. Retrying is safe because a release
is idempotent by request id and may even run before its admission (see
`ratelimit.lua`).

Bounded twice: a release is dropped once its lease must have ended (the backend
has freed the slots by itself), and at most `max_pending` wait (the oldest is
dropped first). Both are counted in `abandoned`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ratelimit.base import Reservation

log = logging.getLogger("sluice.ratelimit")

# One attempt: True when the backend took the release (whatever it found), False when it could not answer.
Attempt = Callable[[Reservation, int], Awaitable[bool]]


@dataclass(frozen=True)
class RetryPolicy:
    """How the background retries pace themselves."""

    first_delay_s: float = 0.05
    """Wait before the first retry, and after a round in which everything landed."""
    max_delay_s: float = 1.0
    """Longest wait between rounds while the backend stays away (the backoff doubles up to it)."""
    max_pending: int = 10_000
    """Releases kept at most; past it the oldest is abandoned (its lease frees it)."""


@dataclass(frozen=True)
class _Pending:
    reservation: Reservation
    refund: int
    give_up_at: float


class ReleaseRetrier:
    """Keeps releases that failed and retries them with `attempt` until they land or their lease ends."""

    def __init__(
        self,
        attempt: Attempt,
        lease_s: float,
        policy: RetryPolicy = RetryPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._attempt = attempt
        self._lease_s = lease_s
        self._policy = policy
        self._clock = clock
        # Insertion-ordered: oldest first, for retries and for dropping when full.
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._task: asyncio.Task[None] | None = None
        self.abandoned = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, reservation: Reservation, refund: int) -> None:
        """Retry this release in the background; a second add of the same request id is a no-op.

        The lease began at or before now, so it has surely ended `lease_s` from now."""
        key = (reservation.tenant_id, reservation.request_id)
        if key in self._pending:
            return
        if len(self._pending) >= self._policy.max_pending:
            del self._pending[next(iter(self._pending))]
            self.abandoned += 1
            log.warning("ratelimit release dropped: too many waiting", extra={"pending": len(self._pending)})
        self._pending[key] = _Pending(reservation, refund, self._clock() + self._lease_s)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ratelimit-release-retry")

    async def close(self) -> None:
        """Stop retrying after one last round (each attempt is bounded by the backend's timeout)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._pending:
            await self._round()
        if self._pending:
            self.abandoned += len(self._pending)
            log.warning(
                "ratelimit releases not delivered at shutdown; their leases will free them",
                extra={"count": len(self._pending)},
            )
            self._pending.clear()

    async def _run(self) -> None:
        delay = self._policy.first_delay_s
        while self._pending:
            await asyncio.sleep(delay)
            if await self._round():
                delay = self._policy.first_delay_s
            else:
                delay = min(delay * 2, self._policy.max_delay_s)

    async def _round(self) -> bool:
        """Try every waiting release, oldest first; False at the first the backend could not take."""
        for key in list(self._pending):
            waiting = self._pending.get(key)
            if waiting is None:
                continue
            if self._clock() >= waiting.give_up_at:  # the lease has freed it by now
                del self._pending[key]
                self.abandoned += 1
                continue
            if not await self._attempt(waiting.reservation, waiting.refund):
                return False
            self._pending.pop(key, None)
        return True
