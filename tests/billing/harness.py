"""Shared scenario pieces: a migrated database with linked tenants, usage written by the real usage
writer (so through the outbox in the usage transaction), relays pointed at the stand-in."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from stripe_standin import RunningStandIn

from billing.config import BillingConfig
from billing.ledger import BillingOutbox
from billing.models import BillingEvent, BillingLine
from billing.relay import BillingRelay
from billing.stripe_meters import StripeMeters
from tenants.db import create_engine, run_migrations, session_factory
from tenants.service import TenantService, TenantSpec
from tenants.usage import UsageEvent, UsageWriter, UsageWriterConfig
from tests.polling import await_until

Sessions = async_sessionmaker[AsyncSession]
HANG_S = 60.0
PROMPT_METER, COMPLETION_METER = "sluice_prompt_tokens", "sluice_completion_tokens"
QUICK_WRITER = UsageWriterConfig(flush_interval_s=0.02)


def config(standin: RunningStandIn, **fields: Any) -> BillingConfig:
    base = BillingConfig(
        prompt_meter=PROMPT_METER,
        completion_meter=COMPLETION_METER,
        window_s=60,
        settle_s=0.0,
        stripe_api_key="sk_test_standin",
        stripe_api_base=standin.base_url,
        poll_interval_s=0.05,
        request_timeout_s=1.0,
        lease_s=2.0,
        retry_initial_s=0.02,
        retry_max_s=0.1,
    )
    return replace(base, **fields)


def run(url: str, scenario: Callable[[AsyncEngine, Sessions], Awaitable[None]]) -> None:
    async def main() -> None:
        db = create_engine(url)
        await run_migrations(db)
        try:
            await scenario(db, session_factory(db))
        finally:
            await db.dispose()

    asyncio.run(main())


async def linked_tenant(sessions: Sessions, customer: str | None = None) -> str:
    tenants = TenantService(sessions)
    tenant = await tenants.create_tenant(TenantSpec(name=f"t-{uuid.uuid4().hex[:8]}"))
    await tenants.update_tenant(tenant.id, {"stripe_customer_id": customer or f"cus_{uuid.uuid4().hex[:14]}"})
    return tenant.id


async def write_usage(
    sessions: Sessions, cfg: BillingConfig, tenant_id: str, requests: int, minutes_ago: float = 10.0
) -> tuple[int, int]:
    """`requests` usage records through the real writer, spread over a few past windows;
    (prompt tokens, completion tokens) written."""
    writer = UsageWriter(sessions, QUICK_WRITER, BillingOutbox(list(cfg.meters), cfg.window_s))
    writer.start()
    now = dt.datetime.now(dt.UTC)
    prompt = completion = 0
    for i in range(requests):
        p, c = 7 + i % 5, 3 + i % 11
        writer.record(UsageEvent(
            request_id=f"req-{uuid.uuid4().hex}", tenant_id=tenant_id, key_id=None, model="m",
            prompt_tokens=p, completion_tokens=c, ttft_ms=1.0, latency_ms=2.0, status="ok",
            created_at=now - dt.timedelta(minutes=minutes_ago - (i % 4)),
        ))
        prompt, completion = prompt + p, completion + c
    await writer.close()
    assert writer.written == requests and not writer.dropped
    return prompt, completion


def relay(sessions: Sessions, cfg: BillingConfig) -> BillingRelay:
    return BillingRelay(sessions, cfg, StripeMeters(cfg))


async def drain(r: BillingRelay, sessions: Sessions, until_settled: bool = True) -> None:
    """Passes until no event is pending (a deadline only catches hangs)."""
    async def settled() -> bool:
        await r.run_once()
        return not until_settled or await pending(sessions) == 0

    await await_until(settled, "no billing event left pending", HANG_S)


async def pending(sessions: Sessions) -> int:
    async with sessions() as session:
        events = await session.execute(
            select(func.count()).select_from(BillingEvent).where(BillingEvent.status == "pending")
        )
        lines = await session.execute(
            select(func.count()).select_from(BillingLine).where(BillingLine.event_id.is_(None))
        )
        return int(events.scalar_one()) + int(lines.scalar_one())


async def ledger_tokens(sessions: Sessions, tenant_id: str, meter: str) -> int:
    async with sessions() as session:
        result = await session.execute(
            select(func.coalesce(func.sum(BillingLine.value), 0)).where(
                BillingLine.tenant_id == tenant_id, BillingLine.meter == meter
            )
        )
        return int(result.scalar_one())


async def events(sessions: Sessions) -> list[BillingEvent]:
    async with sessions() as session:
        return list((await session.execute(select(BillingEvent).order_by(BillingEvent.id))).scalars())


async def customer_of(sessions: Sessions, tenant_id: str) -> str:
    tenant = await TenantService(sessions).get_tenant(tenant_id)
    assert tenant.stripe_customer_id
    return tenant.stripe_customer_id
