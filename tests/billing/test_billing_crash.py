"""A relay killed between Stripe's 200 and its database update, and two relays at once on PostgreSQL:
Stripe still counts every event once, and its count equals the ledger."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from harness import (
    COMPLETION_METER,
    PROMPT_METER,
    Sessions,
    config,
    customer_of,
    drain,
    events,
    ledger_tokens,
    linked_tenant,
    pending,
    relay,
    run,
    write_usage,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from stripe_standin import RunningStandIn

from billing.config import COMPLETION, PROMPT
from tenants.db import create_engine, session_factory
from tests.polling import await_until

ROOT = Path(__file__).resolve().parents[2]


async def stripe_equals_ledger(standin: RunningStandIn, sessions: Sessions, tenants: list[str]) -> None:
    for tenant in tenants:
        customer = await customer_of(sessions, tenant)
        for meter, name in ((PROMPT, PROMPT_METER), (COMPLETION, COMPLETION_METER)):
            assert standin.app.total(name, customer) == await ledger_tokens(sessions, tenant, meter) > 0
    all_events = await events(sessions)
    assert all(e.status == "sent" for e in all_events)
    assert set(standin.app.events) == {e.identifier for e in all_events}


def test_relay_killed_after_stripes_200_resends_once(db_url: str, stripe_standin: RunningStandIn) -> None:
    """`sluice billing relay` is SIGKILLed while Stripe's 200 is on its way; once its lease runs out
    another relay resends with the same idempotency key and Stripe replays the stored 200."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin)
        tenant = await linked_tenant(sessions)
        await write_usage(sessions, cfg, tenant, 6, minutes_ago=5)
        stripe_standin.app.inject("commit_then_hold")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DATABASE_URL": db_url,
            "STRIPE_API_KEY": "sk_test_standin",
            "SLUICE_STRIPE_API_BASE": stripe_standin.base_url,
            "SLUICE_BILLING_PROMPT_METER": PROMPT_METER,
            "SLUICE_BILLING_COMPLETION_METER": COMPLETION_METER,
            "SLUICE_BILLING_WINDOW_S": "60",
            "SLUICE_BILLING_SETTLE_S": "0",
            "SLUICE_BILLING_LEASE_S": "2",
            "SLUICE_BILLING_TIMEOUT_S": "1.5",
        }
        # A real process, so that the kill is a real SIGKILL; Popen returns at once.
        child = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "gateway.cli", "billing", "relay"], env=env, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        try:
            async def reached_stripe() -> bool:
                assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
                return stripe_standin.app.held.is_set()

            # A loaded 2-core machine starts a Python process slowly: a generous wait.
            await await_until(reached_stripe, "the relay to reach Stripe", timeout_s=180)
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(timeout=60)
        committed = dict(stripe_standin.app.executions)
        assert len(committed) >= 1
        stripe_standin.app.release.set()
        # The killed relay's claims are leased, not lost: after 2 s they are due again.
        r = relay(sessions, cfg)
        await drain(r, sessions)
        await stripe_equals_ledger(stripe_standin, sessions, [tenant])
        assert max(stripe_standin.app.executions.values()) == 1  # replayed, never executed twice
        assert stripe_standin.app.replays >= 1 and not stripe_standin.app.duplicates
        await r.meters.close()

    run(db_url, scenario)


def test_two_relays_at_once_on_postgresql(pg_url: str, stripe_standin: RunningStandIn) -> None:
    """Two relays with their own connection pools seal and claim concurrently (FOR UPDATE SKIP LOCKED):
    no event is ever sent by both."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin, batch_size=3, concurrency=2)
        tenants = [await linked_tenant(sessions) for _ in range(3)]
        for tenant in tenants:
            await write_usage(sessions, cfg, tenant, 16)
        other_engine = create_engine(pg_url)
        other_sessions = session_factory(other_engine)
        a, b = relay(sessions, cfg), relay(other_sessions, cfg)
        # Both pools connected and the first answers slow: neither relay can finish all the work
        # before the other's first claim (on a loaded machine one sometimes did, and the test
        # then proved nothing about two at once).
        await pending(other_sessions)
        await pending(sessions)
        stripe_standin.app.inject(*["slow"] * 4, delay_s=0.3)
        try:
            await asyncio.gather(drain(a, sessions), drain(b, other_sessions))
        finally:
            await other_engine.dispose()
        await stripe_equals_ledger(stripe_standin, sessions, tenants)
        assert a.sent + b.sent == len(await events(sessions)) == 3 * 4 * 2
        assert a.sent and b.sent  # both did work
        # no relay ever claimed more than its batch (a LIMITed SKIP LOCKED subquery inside an UPDATE can)
        assert max(stripe_standin.app.executions.values()) == 1
        assert max(stripe_standin.app.executions.values()) == 1 and not stripe_standin.app.duplicates
        await a.meters.close()
        await b.meters.close()

    run(pg_url, scenario)
