"""The gateway's side of admission (`gateway.admission.TenantGate`) on both limiter backends and a real
SQLite usage database: what a request that ran, and one that never ran, leave behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from ratelimit_support import Backend, StepClock
from sqlalchemy import select

from gateway.admission import TenantGate
from ratelimit.base import TenantLimits
from tenants.auth import TenantContext
from tenants.db import create_engine, run_migrations, session_factory
from tenants.errors import RateLimitedError
from tenants.models import UsageRecord
from tenants.usage import MonthlyUsage, UsageWriter

LIMITS = TenantLimits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=4)
CALLER = TenantContext("tenant-1", "acme", "key-1", 1, LIMITS, monthly_token_budget=None)


async def settled(release: asyncio.Task[None] | None) -> None:
    """Wait for the release a ticket's ending started (there is one: the ticket holds a reservation)."""
    assert release is not None
    await release


def test_a_request_that_never_ran_gives_back_everything_once_and_is_billed_nothing(
    backend: Backend, tmp_path: Path
) -> None:
    async def main() -> None:
        engine = create_engine(f"sqlite:///{tmp_path / 'usage.db'}")
        await run_migrations(engine)
        sessions = session_factory(engine)
        usage = UsageWriter(sessions)
        usage.start()
        gate = TenantGate(backend.make(clock=StepClock()), usage, MonthlyUsage(sessions))
        try:
            # A request of 2 prompts x n=2 takes all four concurrent sequences and every token.
            ticket = await gate.admit(CALLER, "r1", "m", 1000, sequences=4)
            with pytest.raises(RateLimitedError):
                await gate.admit(CALLER, "r2", "m", 1)
            # The engine refuses it (queue full) before it ran: all of it comes back.
            await settled(gate.cancel(ticket, "OverloadedError"))
            assert gate.cancel(ticket, "OverloadedError") is None  # exactly once ...
            assert gate.finish(ticket, 10, 5, None, "ok") is None  # ... whichever ending comes first
            ran = await gate.admit(CALLER, "r3", "m", 1000, sequences=4)
            assert ran.headers["x-ratelimit-remaining-tokens"] == "0"
            await settled(gate.finish(ran, 7, 3, 0.01, "ok"))
        finally:
            await gate.close()
            await usage.close()
            await backend.close()
        async with sessions() as session:
            rows = (await session.execute(select(UsageRecord).order_by(UsageRecord.id))).scalars().all()
        assert [(r.request_id, r.prompt_tokens, r.completion_tokens, r.status) for r in rows] == [
            ("r2", 0, 0, "rate_limited"),
            ("r1", 0, 0, "OverloadedError"),
            ("r3", 7, 3, "ok"),
        ]
        assert await MonthlyUsage(sessions).used(CALLER.tenant_id) == 10
        await engine.dispose()

    asyncio.run(main())
