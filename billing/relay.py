"""The relay: seals closed windows of the ledger into billing events and sends them to Stripe.

One pass:

    seal     lines of closed windows -> one pending event each (tenant, meter, window)   one transaction
    claim    up to batch_size due events, leased to this relay (SKIP LOCKED)            one statement
    send     each claimed event, `concurrency` at a time, through the SDK                no transaction open
    settle   each outcome, only if this relay still holds the lease                      one statement each

Exactly once at Stripe, whatever fails where:

    failure                                   what happens next
    429 / 5xx / timeout / 409                 retried with the same identifier and key, after a backoff
                                              with jitter (initial * 2^(attempts-1), capped, half random)
    Stripe committed, then answered 500       the retry's key replays the stored 500; the next attempt
                                              takes a new key and Stripe answers "identifier already
                                              exists": counted as sent
    relay killed after Stripe's 200           the lease runs out; another relay resends the same key and
                                              Stripe replays the 200 (or, after a new key, the duplicate)
    two relays                                never hold the same event (claims skip locked rows)
    still failing near Stripe's windows       dead-lettered: before the identifier's 24 h de-duplication
                                              ends (a resend could count twice) and before the 35-day
                                              timestamp limit; reconciliation settles dead events
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.config import BillingConfig
from billing.repository import BillingRepository, ClaimedEvent, RelayState
from billing.stripe_meters import MeterEventToSend, Outcome, SendResult, StripeMeters
from tenants.models import utcnow

log = logging.getLogger("sluice.billing")


@dataclass(frozen=True, slots=True)
class PassResult:
    sealed: int
    claimed: int


class BillingRelay:
    """Counters (monotonic, for metrics): `sent`, `duplicates`, `dead_lettered`, `failures` per reason;
    `state` is the outbox as the last pass saw it."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        config: BillingConfig,
        meters: StripeMeters,
        rng: random.Random | None = None,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self.sessions = sessions
        self.config = config
        self.meters = meters
        self.relay_id = f"relay-{uuid.uuid4()}"
        self.rng = rng or random.Random()
        self.clock = clock
        self.sent = 0
        self.duplicates = 0
        self.dead_lettered = 0
        self.failures: Counter[str] = Counter()
        self.state: RelayState | None = None
        self.state_at: dt.datetime | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="billing-relay")

    def request_stop(self) -> None:
        """Finish the pass under way, then return from run() (a signal handler's job)."""
        self._stop.set()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def run(self) -> None:
        """Passes until stop(); a pass that found work is followed at once by the next."""
        while not self._stop.is_set():
            try:
                result = await self.run_once()
                busy = result.claimed >= self.config.batch_size or result.sealed > 0
            except Exception:
                log.exception("billing relay pass failed", extra={"relay": self.relay_id})
                busy = False
            if not busy:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.poll_interval_s)

    # -- one pass -------------------------------------------------------------------------------------

    async def run_once(self) -> PassResult:
        now = self.clock()
        cfg = self.config
        async with self.sessions.begin() as session:
            closed_before = now - dt.timedelta(seconds=cfg.window_s + cfg.settle_s)
            sealed = await BillingRepository(session).seal(cfg.meters, closed_before)
        now = self.clock()  # after the seal: the events it just made are due
        async with self.sessions.begin() as session:
            lease = now + dt.timedelta(seconds=cfg.lease_s)
            claimed = await BillingRepository(session).claim(self.relay_id, now, lease, cfg.batch_size)
        gate = asyncio.Semaphore(cfg.concurrency)

        async def deliver(event: ClaimedEvent) -> None:
            async with gate:
                await self._deliver(event)

        await asyncio.gather(*(deliver(e) for e in claimed))
        await self.refresh_state()
        return PassResult(len(sealed), len(claimed))

    async def refresh_state(self) -> RelayState:
        async with self.sessions() as session:
            self.state = await BillingRepository(session).state()
        self.state_at = self.clock()
        return self.state

    async def _deliver(self, event: ClaimedEvent) -> None:
        now = self.clock()
        too_old = now - dt.timedelta(seconds=self.config.max_event_age_s)
        if event.window_start < too_old:
            result = SendResult(Outcome.REFUSED, "too_old", "older than Stripe accepts (35 days)")
        else:
            result = await self.meters.send(
                MeterEventToSend(
                    event_name=event.event_name,
                    stripe_customer_id=event.stripe_customer_id,
                    value=event.value,
                    timestamp=event.window_start,
                    identifier=event.identifier,
                    idempotency_key=event.idempotency_key,
                )
            )
        await self._settle(event, result)

    async def _settle(self, event: ClaimedEvent, result: SendResult) -> None:
        now = self.clock()
        async with self.sessions.begin() as session:
            repo = BillingRepository(session)
            if result.outcome in (Outcome.ACCEPTED, Outcome.DUPLICATE):
                held = await repo.mark_sent(event.id, self.relay_id, now)
                if held:
                    self.sent += 1
                    self.duplicates += result.outcome is Outcome.DUPLICATE
                return
            self.failures[result.reason] += 1
            if result.outcome is Outcome.RETRY:
                at = now + dt.timedelta(seconds=self._backoff_s(event.attempts))
                if at < self._deadline(event):
                    await repo.mark_retry(event.id, self.relay_id, at, result.detail, result.new_key)
                    log.warning(
                        "billing event send failed, will retry",
                        extra={"identifier": event.identifier, "attempts": event.attempts,
                               "reason": result.reason, "error": result.detail},
                    )
                    return
                detail = f"still failing when Stripe's windows close: {result.detail}"
            else:
                detail = result.detail
            if await repo.mark_dead(event.id, self.relay_id, detail):
                self.dead_lettered += 1
                log.error(
                    "billing event dead-lettered",
                    extra={"identifier": event.identifier, "value": event.value,
                           "reason": result.reason, "error": detail},
                )

    def _backoff_s(self, attempts: int) -> float:
        """Exponential, capped, with half of it random so that relays retrying together spread out."""
        cfg = self.config
        ceiling = min(cfg.retry_max_s, cfg.retry_initial_s * 2 ** max(0, attempts - 1))
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def _deadline(self, event: ClaimedEvent) -> dt.datetime:
        """The last moment a resend is safe: within the identifier's de-duplication window (counted from
        the first attempt, which Stripe may have counted) and within Stripe's 35-day timestamp limit."""
        cfg = self.config
        return min(
            event.first_attempt_at + dt.timedelta(seconds=cfg.dedup_horizon_s),
            event.window_start + dt.timedelta(seconds=cfg.max_event_age_s),
        )
