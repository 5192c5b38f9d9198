"""What the console and the admin API show of billing: a tenant's billed usage per day, the relay's state."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.repository import BillingRepository, RelayState

STATES = ("sent", "pending", "unsealed", "dead", "adjusted")


@dataclass(frozen=True, slots=True)
class BilledDay:
    day: str  # YYYY-MM-DD (UTC) of the windows
    meter: str
    tokens: dict[str, int]  # state (STATES) -> tokens


async def billed_usage(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, start: dt.datetime, end: dt.datetime
) -> list[BilledDay]:
    """A tenant's ledger in [start, end) per UTC day and meter, split by how far it got towards Stripe:
    sent (Stripe counted it), pending (in an event, not yet sent), unsealed (its window not closed, or
    the tenant not linked), dead (given up, to be reconciled), adjusted (covered by an adjustment)."""
    async with sessions() as session:
        rows = await BillingRepository(session).billed(tenant_id, start, end)
    days: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(STATES, 0))
    for window, meter, state, tokens in rows:
        days[(window.strftime("%Y-%m-%d"), meter)][state] += tokens
    return [BilledDay(day, meter, tokens) for (day, meter), tokens in sorted(days.items())]


async def relay_state(sessions: async_sessionmaker[AsyncSession]) -> RelayState:
    async with sessions() as session:
        return await BillingRepository(session).state()
