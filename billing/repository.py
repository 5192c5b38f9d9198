"""Queries over the billing tables, bound to a session the caller owns.

Claiming on PostgreSQL locks due events with `SELECT ... FOR UPDATE SKIP LOCKED`, then leases them with an
UPDATE in the same transaction: two relays never claim the same event and never wait on each other.
SQLite (no FOR UPDATE) leases them in one `UPDATE ... WHERE id IN (SELECT ...)` under its single write lock.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from billing.models import BillingEvent, BillingLine, EventKind, EventStatus
from tenants.models import Tenant


@dataclass(frozen=True, slots=True)
class ClaimedEvent:
    """An event a relay holds until `lease_until`: what it needs to send it."""

    id: int
    identifier: str
    idempotency_key: str
    event_name: str
    stripe_customer_id: str
    window_start: dt.datetime
    value: int
    attempts: int  # including this one
    first_attempt_at: dt.datetime

@dataclass(frozen=True, slots=True)
class RelayState:
    """What the admin sees of the relay: events per status (count, tokens) and how far behind it is."""

    events: dict[str, tuple[int, int]]
    unsealed_lines: int
    unlinked_lines: int  # lines of tenants without a Stripe customer: recorded, never sent
    oldest_pending_at: dt.datetime | None
    oldest_unsealed_window: dt.datetime | None
    dead: list[BillingEvent]

def usage_identifier(tenant_id: str, meter: str, window: dt.datetime, first_line_id: int) -> str:
    """Derived from the ledger alone: the tenant, meter and window, and the first line sealed into the
    event (so late lines sealed into a second event of the same window get a different one). At most
    7 + 36 + 1 + 10 + 1 + 12 + 1 + 20 = 88 characters: Stripe allows 100."""
    return f"sluice_{tenant_id}_{meter}_{int(window.timestamp())}_{first_line_id}"

class BillingRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    # -- sealing lines into events ------------------------------------------------------------------

    async def seal(
        self, meters: dict[str, str], closed_before: dt.datetime, limit: int = 5000
    ) -> list[int]:
        """Seal unsealed lines of linked tenants in windows starting before `closed_before` into one
        pending event per tenant, meter and window; the new events' ids. Lines of meters no longer
        configured, and of tenants without a Stripe customer, stay unsealed."""
        if self.session.get_bind().dialect.name == "sqlite":
            # Take the write lock before reading: a read transaction that writes after another writer
            # (a usage flush) committed fails at once on SQLite instead of waiting its turn.
            await self.session.execute(text("UPDATE billing_lines SET event_id = event_id WHERE 0"))
        query = (
            select(
                BillingLine.id,
                BillingLine.tenant_id,
                BillingLine.meter,
                BillingLine.window_start,
                BillingLine.value,
                Tenant.stripe_customer_id,
            )
            .join(Tenant, Tenant.id == BillingLine.tenant_id)
            .where(
                BillingLine.event_id.is_(None),
                BillingLine.window_start < closed_before,
                BillingLine.meter.in_(list(meters)),
                Tenant.stripe_customer_id.is_not(None),
            )
            .order_by(BillingLine.id)
            .limit(limit)
            .with_for_update(of=BillingLine, skip_locked=True)
        )
        groups: dict[tuple[str, str, dt.datetime], list[tuple[int, int, str]]] = defaultdict(list)
        for line_id, tenant_id, meter, window, value, customer in await self.session.execute(query):
            groups[(tenant_id, meter, window)].append((line_id, value, str(customer)))
        sealed: list[int] = []
        for (tenant_id, meter, window), lines in groups.items():
            ids = [line_id for line_id, _, _ in lines]
            event = BillingEvent(
                identifier=usage_identifier(tenant_id, meter, window, min(ids)),
                kind=EventKind.USAGE.value,
                tenant_id=tenant_id,
                meter=meter,
                event_name=meters[meter],
                stripe_customer_id=lines[0][2],
                window_start=window,
                value=sum(value for _, value, _ in lines),
                status=EventStatus.PENDING.value,
                attempts=0,
                key_generation=0,
            )
            self.session.add(event)
            await self.session.flush()
            done = await self.session.execute(
                update(BillingLine)
                .where(BillingLine.id.in_(ids), BillingLine.event_id.is_(None))
                .values(event_id=event.id)
            )
            if done.rowcount != len(ids):  # type: ignore[attr-defined]
                raise RuntimeError("billing lines sealed twice")  # rolls the whole seal back
            sealed.append(event.id)
        return sealed

    async def add_adjustment(self, event: BillingEvent) -> bool:
        """Record a reconciliation adjustment to send; False when one with its identifier exists."""
        exists = await self.session.execute(
            select(BillingEvent.id).where(BillingEvent.identifier == event.identifier)
        )
        if exists.first() is not None:
            return False
        self.session.add(event)
        await self.session.flush()
        return True

    # -- the relay's claim and its outcomes ------------------------------------------------------------

    async def claim(
        self, relay_id: str, now: dt.datetime, lease_until: dt.datetime, limit: int
    ) -> list[ClaimedEvent]:
        due = self._due(now)
        pick = select(BillingEvent.id).where(due).order_by(BillingEvent.next_attempt_at, BillingEvent.id)
        ids: Any
        if self.session.get_bind().dialect.name == "postgresql":
            # Locked first, in a statement of its own: inside `UPDATE ... WHERE id IN (subquery)` PostgreSQL
            # may run a LIMITed SKIP LOCKED subquery more than once and claim more than `limit` rows.
            ids = list((await self.session.execute(pick.limit(limit).with_for_update(skip_locked=True))).scalars())
            if not ids:
                return []
        else:  # SQLite: one statement under the database's single write lock
            ids = pick.limit(limit).scalar_subquery()
        statement = (
            update(BillingEvent)
            .where(BillingEvent.id.in_(ids), due)
            .values(
                claimed_by=relay_id,
                lease_until=lease_until,
                attempts=BillingEvent.attempts + 1,
                first_attempt_at=func.coalesce(BillingEvent.first_attempt_at, now),
            )
            .returning(
                BillingEvent.id,
                BillingEvent.identifier,
                BillingEvent.key_generation,
                BillingEvent.event_name,
                BillingEvent.stripe_customer_id,
                BillingEvent.window_start,
                BillingEvent.value,
                BillingEvent.attempts,
                BillingEvent.first_attempt_at,
            )
            .execution_options(synchronize_session=False)
        )
        claimed = []
        for row in await self.session.execute(statement):
            key = row.identifier if not row.key_generation else f"{row.identifier}~{row.key_generation}"
            claimed.append(
                ClaimedEvent(
                    row.id, row.identifier, key, row.event_name, row.stripe_customer_id,
                    _utc(row.window_start), row.value, row.attempts, _utc(row.first_attempt_at),
                )
            )
        return sorted(claimed, key=lambda e: e.id)

    @staticmethod
    def _due(now: dt.datetime) -> ColumnElement[bool]:
        return and_(
            BillingEvent.status == EventStatus.PENDING.value,
            BillingEvent.next_attempt_at <= now,
            or_(BillingEvent.lease_until.is_(None), BillingEvent.lease_until < now),
        )

    async def mark_sent(self, event_id: int, relay_id: str, now: dt.datetime) -> bool:
        return await self._settle(
            event_id, relay_id, status=EventStatus.SENT.value, sent_at=now, last_error=None
        )

    async def mark_retry(
        self, event_id: int, relay_id: str, at: dt.datetime, error: str, new_key: bool
    ) -> bool:
        values: dict[str, object] = {"next_attempt_at": at, "last_error": error[:500]}
        if new_key:
            values["key_generation"] = BillingEvent.key_generation + 1
        return await self._settle(event_id, relay_id, **values)

    async def mark_dead(self, event_id: int, relay_id: str, error: str) -> bool:
        return await self._settle(event_id, relay_id, status=EventStatus.DEAD.value, last_error=error[:500])

    async def _settle(self, event_id: int, relay_id: str, **values: object) -> bool:
        """Apply an attempt's outcome, only while this relay still holds the event: one whose lease ran
        out belongs to whichever relay claimed it since (it resends with the same identifier)."""
        result = await self.session.execute(
            update(BillingEvent)
            .where(
                BillingEvent.id == event_id,
                BillingEvent.claimed_by == relay_id,
                BillingEvent.status == EventStatus.PENDING.value,
            )
            .values(claimed_by=None, lease_until=None, **values)
            .execution_options(synchronize_session=False)
        )
        return bool(result.rowcount)  # type: ignore[attr-defined]

    # -- reports --------------------------------------------------------------------------------------

    async def state(self, dead_limit: int = 50) -> RelayState:
        events = {
            str(status): (int(n), int(v or 0))
            for status, n, v in await self.session.execute(
                select(BillingEvent.status, func.count(), func.sum(BillingEvent.value)).group_by(
                    BillingEvent.status
                )
            )
        }
        unsealed = BillingLine.event_id.is_(None)
        linked = select(Tenant.id).where(Tenant.stripe_customer_id.is_not(None))
        unsealed_lines, oldest_window = (
            await self.session.execute(
                select(func.count(), func.min(BillingLine.window_start)).where(
                    unsealed, BillingLine.tenant_id.in_(linked)
                )
            )
        ).one()
        unlinked = (
            await self.session.execute(
                select(func.count()).where(unsealed, BillingLine.tenant_id.not_in(linked))
            )
        ).scalar_one()
        oldest_pending = (
            await self.session.execute(
                select(func.min(BillingEvent.created_at)).where(
                    BillingEvent.status == EventStatus.PENDING.value
                )
            )
        ).scalar_one()
        dead = (
            await self.session.execute(
                select(BillingEvent)
                .where(BillingEvent.status == EventStatus.DEAD.value)
                .order_by(BillingEvent.id.desc())
                .limit(dead_limit)
            )
        ).scalars().all()
        return RelayState(
            events, int(unsealed_lines), int(unlinked), _aware(oldest_pending), _aware(oldest_window),
            list(dead),
        )

    async def ledger(
        self, tenant_id: str, meter: str, start: dt.datetime, end: dt.datetime
    ) -> tuple[int, int]:
        """(tokens in the ledger, tokens not at Stripe yet: unsealed lines + pending events) of windows
        starting in [start, end)."""
        in_period = and_(
            BillingLine.tenant_id == tenant_id,
            BillingLine.meter == meter,
            BillingLine.window_start >= start,
            BillingLine.window_start < end,
        )
        total, unsealed = (
            await self.session.execute(
                select(
                    func.coalesce(func.sum(BillingLine.value), 0),
                    func.coalesce(
                        func.sum(BillingLine.value).filter(BillingLine.event_id.is_(None)), 0
                    ),
                ).where(in_period)
            )
        ).one()
        pending = (
            await self.session.execute(
                select(func.coalesce(func.sum(BillingEvent.value), 0)).where(
                    *self._events_in(tenant_id, meter, start, end),
                    BillingEvent.status == EventStatus.PENDING.value,
                )
            )
        ).scalar_one()
        return int(total), int(unsealed) + int(pending)

    async def sent_adjustments(self, tenant_id: str, meter: str, start: dt.datetime, end: dt.datetime) -> int:
        result = await self.session.execute(
            select(func.coalesce(func.sum(BillingEvent.value), 0)).where(
                *self._events_in(tenant_id, meter, start, end),
                BillingEvent.kind == EventKind.ADJUSTMENT.value,
                BillingEvent.status == EventStatus.SENT.value,
            )
        )
        return int(result.scalar_one())

    async def mark_adjusted(self, tenant_id: str, meter: str, start: dt.datetime, end: dt.datetime) -> int:
        result = await self.session.execute(
            update(BillingEvent)
            .where(
                *self._events_in(tenant_id, meter, start, end),
                BillingEvent.status == EventStatus.DEAD.value,
            )
            .values(status=EventStatus.ADJUSTED.value)
            .execution_options(synchronize_session=False)
        )
        return int(result.rowcount)  # type: ignore[attr-defined]

    @staticmethod
    def _events_in(
        tenant_id: str, meter: str, start: dt.datetime, end: dt.datetime
    ) -> Sequence[ColumnElement[bool]]:
        return (
            BillingEvent.tenant_id == tenant_id,
            BillingEvent.meter == meter,
            BillingEvent.window_start >= start,
            BillingEvent.window_start < end,
        )

    async def billed(
        self, tenant_id: str, start: dt.datetime, end: dt.datetime
    ) -> list[tuple[dt.datetime, str, str, int]]:
        """(window, meter, state, tokens) of a tenant's ledger in [start, end): state is an event status,
        or "unsealed" for lines not in an event yet."""
        lines = await self.session.execute(
            select(BillingLine.window_start, BillingLine.meter, func.sum(BillingLine.value))
            .where(
                BillingLine.tenant_id == tenant_id,
                BillingLine.event_id.is_(None),
                BillingLine.window_start >= start,
                BillingLine.window_start < end,
            )
            .group_by(BillingLine.window_start, BillingLine.meter)
        )
        events = await self.session.execute(
            select(
                BillingEvent.window_start, BillingEvent.meter, BillingEvent.status, func.sum(BillingEvent.value)
            )
            .where(
                BillingEvent.tenant_id == tenant_id,
                BillingEvent.window_start >= start,
                BillingEvent.window_start < end,
            )
            .group_by(BillingEvent.window_start, BillingEvent.meter, BillingEvent.status)
        )
        rows = [(_aware(w), m, "unsealed", int(v)) for w, m, v in lines]
        rows += [(_aware(w), m, str(s), int(v)) for w, m, s, v in events]
        return rows  # type: ignore[return-value]

    async def linked_tenants(self) -> list[tuple[str, str, str]]:
        """(id, name, stripe customer id) of every tenant linked to Stripe."""
        rows = await self.session.execute(
            select(Tenant.id, Tenant.name, Tenant.stripe_customer_id)
            .where(Tenant.stripe_customer_id.is_not(None))
            .order_by(Tenant.name)
        )
        return [(str(i), str(n), str(c)) for i, n, c in rows]

def _utc(value: dt.datetime | str) -> dt.datetime:
    aware = _aware(value)
    assert aware is not None
    return aware


def _aware(value: dt.datetime | str | None) -> dt.datetime | None:
    """Raw column reads (RETURNING, aggregates) bypass UTCDateTime on SQLite: naive there means UTC."""
    if value is None:
        return None
    if isinstance(value, str):  # SQLite's min() over a datetime column returns its text
        value = dt.datetime.fromisoformat(value)
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
