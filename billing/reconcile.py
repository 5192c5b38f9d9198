"""Reconciliation: Stripe's meter event summaries against the ledger, per tenant and meter, over a period.

For a linked tenant, a meter and the windows starting in [start, end):

    ledger      tokens in billing_lines (what the tenant used)
    in flight   tokens not at Stripe yet: unsealed lines and pending events (the relay will send them)
    stripe      the meter event summary's aggregated_value for the customer over [start, end)
    difference  ledger - in flight - stripe

A positive difference is usage Stripe never counted (dead-lettered events, or events Stripe lost).
With `apply`, it is queued as one adjustment event (a meter event like the others, timestamped inside the
period; the relay sends it), and the dead events it covers become `adjusted`. Its identifier is derived
from the period and the totals compared, so running reconciliation again before Stripe has counted it
cannot bill it twice. A negative difference (Stripe counted more) is reported, never sent: Stripe can
only cancel single events, within 24 hours of receiving them.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.config import BillingConfig
from billing.models import BillingEvent, EventKind, EventStatus
from billing.repository import BillingRepository
from billing.stripe_meters import StripeMeters
from tenants.models import utcnow


@dataclass(frozen=True, slots=True)
class MeterDifference:
    tenant_id: str
    tenant_name: str
    customer: str
    meter: str
    ledger: int
    in_flight: int
    stripe: int
    action: str  # "ok", "under-billed", "adjustment queued", "over-billed", "too old to adjust"

    @property
    def difference(self) -> int:
        return self.ledger - self.in_flight - self.stripe


def parse_period(text: str) -> tuple[dt.datetime, dt.datetime]:
    """"2026-12" (a UTC month), "2026-12-01" (a UTC day) or "START/END" (ISO 8601, UTC if naive)."""
    if "/" in text:
        start_text, end_text = text.split("/", 1)
        start, end = _utc(dt.datetime.fromisoformat(start_text)), _utc(dt.datetime.fromisoformat(end_text))
    elif len(text) == 7:
        start = dt.datetime.strptime(text, "%Y-%m").replace(tzinfo=dt.UTC)
        end = (start + dt.timedelta(days=32)).replace(day=1)
    else:
        start = dt.datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=dt.UTC)
        end = start + dt.timedelta(days=1)
    if start.second or start.microsecond or end.second or end.microsecond:
        raise ValueError("Stripe's summaries need a period aligned to whole minutes")
    if start >= end:
        raise ValueError("the period must start before it ends")
    return start, end


def _utc(value: dt.datetime) -> dt.datetime:
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def adjustment_identifier(line: MeterDifference, start: dt.datetime, end: dt.datetime) -> str:
    facts = f"{line.tenant_id}|{line.meter}|{start.isoformat()}|{end.isoformat()}|{line.ledger}|{line.stripe}"
    return "sluice_adj_" + hashlib.sha256(facts.encode()).hexdigest()[:40]


async def reconcile(
    sessions: async_sessionmaker[AsyncSession],
    config: BillingConfig,
    meters: StripeMeters,
    start: dt.datetime,
    end: dt.datetime,
    apply: bool = False,
) -> list[MeterDifference]:
    async with sessions() as session:
        tenants = await BillingRepository(session).linked_tenants()
    lines: list[MeterDifference] = []
    for tenant_id, name, customer in tenants:
        for meter, event_name in config.meters.items():
            async with sessions() as session:
                ledger, in_flight = await BillingRepository(session).ledger(tenant_id, meter, start, end)
            stripe_total = round(await meters.summed(event_name, customer, start, end))
            line = MeterDifference(tenant_id, name, customer, meter, ledger, in_flight, stripe_total, "ok")
            if line.difference > 0:
                action = "under-billed"
                if apply:
                    action = await _queue_adjustment(sessions, config, line, event_name, start, end)
                line = _with_action(line, action)
            elif line.difference < 0:
                line = _with_action(line, "over-billed")
            lines.append(line)
    return lines


async def _queue_adjustment(
    sessions: async_sessionmaker[AsyncSession],
    config: BillingConfig,
    line: MeterDifference,
    event_name: str,
    start: dt.datetime,
    end: dt.datetime,
) -> str:
    now = utcnow()
    # Inside the period, within Stripe's 35 days, not in the future, on a minute.
    oldest = now - dt.timedelta(seconds=config.max_event_age_s)
    at = max(start, oldest.replace(second=0, microsecond=0) + dt.timedelta(minutes=1))
    if at >= end or at > now:
        return "too old to adjust"
    event = BillingEvent(
        identifier=adjustment_identifier(line, start, end),
        kind=EventKind.ADJUSTMENT.value,
        tenant_id=line.tenant_id,
        meter=line.meter,
        event_name=event_name,
        stripe_customer_id=line.customer,
        window_start=at,
        value=line.difference,
        status=EventStatus.PENDING.value,
        attempts=0,
        key_generation=0,
        next_attempt_at=now,
    )
    async with sessions.begin() as session:
        repo = BillingRepository(session)
        if not await repo.add_adjustment(event):
            return "adjustment already queued"
        await repo.mark_adjusted(line.tenant_id, line.meter, start, end)
    return "adjustment queued"


def _with_action(line: MeterDifference, action: str) -> MeterDifference:
    return MeterDifference(
        line.tenant_id, line.tenant_name, line.customer, line.meter, line.ledger, line.in_flight,
        line.stripe, action,
    )
