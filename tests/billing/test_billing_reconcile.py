"""Dead-lettering and reconciliation: an event that keeps failing is given up before Stripe's windows
close; `reconcile` finds what Stripe did not count, queues one adjustment, and then Stripe == ledger."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import stripe
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
    relay,
    run,
    write_usage,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from stripe_standin import RunningStandIn

from billing.config import COMPLETION, PROMPT
from billing.reconcile import parse_period, reconcile
from billing.stripe_meters import StripeMeters

ROOT = Path(__file__).resolve().parents[2]


def period() -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    return now - dt.timedelta(hours=2), now + dt.timedelta(minutes=1)


def test_dead_letters_are_reconciled_into_one_adjustment(db_url: str, stripe_standin: RunningStandIn) -> None:
    """The relay gives up on two events (a refusal, and 500s past the de-duplication horizon); one other
    event was committed by Stripe before its 500 and dead-lettered all the same. Reconciliation bills
    exactly the tokens Stripe never counted, once, however often it runs."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        # dedup_horizon_s=0: the first retryable failure is already past the safe resend window
        cfg = config(stripe_standin, concurrency=1, dedup_horizon_s=0.0)
        tenant = await linked_tenant(sessions)
        await write_usage(sessions, cfg, tenant, 12)
        stripe_standin.app.inject("500", "commit_then_500")
        r = relay(sessions, cfg)
        await drain(r, sessions)
        dead = [e for e in await events(sessions) if e.status == "dead"]
        assert len(dead) == 2 and r.dead_lettered == 2
        assert all("windows close" in (e.last_error or "") for e in dead)
        counted_anyway = next(e for e in dead if e.identifier in stripe_standin.app.events)
        lost = next(e for e in dead if e.identifier not in stripe_standin.app.events)

        start, end = period()
        meters = StripeMeters(cfg)
        report = await reconcile(sessions, cfg, meters, start, end)
        short = {x.meter: x.difference for x in report if x.difference}
        assert short == {lost.meter: lost.value}  # the committed one is not billed again
        assert all(x.action == "under-billed" for x in report if x.difference)

        applied = await reconcile(sessions, cfg, meters, start, end, apply=True)
        assert [x.action for x in applied if x.difference] == ["adjustment queued"]
        again = await reconcile(sessions, cfg, meters, start, end, apply=True)
        assert not [x for x in again if x.difference]  # the queued adjustment is in flight
        await drain(r, sessions)
        customer = await customer_of(sessions, tenant)
        for meter, name in ((PROMPT, PROMPT_METER), (COMPLETION, COMPLETION_METER)):
            assert stripe_standin.app.total(name, customer) == await ledger_tokens(sessions, tenant, meter)
        statuses = {e.identifier: e.status for e in await events(sessions)}
        assert statuses[lost.identifier] == "adjusted" and statuses[counted_anyway.identifier] in ("dead", "adjusted")
        assert not [x for x in await reconcile(sessions, cfg, meters, start, end, apply=True) if x.difference]
        await meters.close()
        await r.meters.close()

    run(db_url, scenario)


def test_over_billing_is_reported_never_sent(tmp_path: Path, stripe_standin: RunningStandIn) -> None:
    """Usage Stripe has and the ledger does not (sent by someone else) is reported by the command,
    which exits 1; nothing is sent for it."""
    url = f"sqlite:///{tmp_path / 'billing.db'}"

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin)
        tenant = await linked_tenant(sessions, "cus_Over1")
        await write_usage(sessions, cfg, tenant, 4)
        r = relay(sessions, cfg)
        await drain(r, sessions)
        await r.meters.close()

    run(url, scenario)
    client = stripe.StripeClient("sk_test_x", base_addresses={"api": stripe_standin.base_url})
    client.v1.billing.meter_events.create(
        {"event_name": PROMPT_METER, "payload": {"stripe_customer_id": "cus_Over1", "value": "5"}}
    )
    start, end = period()
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": url, "STRIPE_API_KEY": "sk_test_standin",
        "SLUICE_STRIPE_API_BASE": stripe_standin.base_url, "SLUICE_BILLING_PROMPT_METER": PROMPT_METER,
        "SLUICE_BILLING_COMPLETION_METER": COMPLETION_METER, "SLUICE_BILLING_WINDOW_S": "60",
    }
    posts = stripe_standin.app.requests["POST /v1/billing/meter_events"]
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "billing", "reconcile", "--apply",
         "--period", f"{start.isoformat()}/{end.isoformat()}"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    over = [line for line in done.stdout.splitlines() if "over-billed" in line]
    assert len(over) == 1 and " -5 " in over[0] and "prompt" in over[0], done.stdout
    assert stripe_standin.app.requests["POST /v1/billing/meter_events"] == posts


def test_period_forms() -> None:
    assert parse_period("2026-02") == (
        dt.datetime(2026, 2, 1, tzinfo=dt.UTC), dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    )
    assert parse_period("2026-12-31")[1] == dt.datetime(2027, 1, 1, tzinfo=dt.UTC)
    for bad in ("2026-02-01T00:00:30/2026-02-02", "2026-02-02/2026-02-01", "yesterday"):
        try:
            parse_period(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")
