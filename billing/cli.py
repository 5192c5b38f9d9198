"""`sluice billing relay` and `sluice billing reconcile --period ...`: the relay and reconciliation as
commands (for a deployment that runs the relay apart from the gateways, and for cron)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

# The commands' modules (SQLAlchemy, httpx, ~0.4 s) are imported when a billing command runs: every `sluice`
# command builds this parser, `sluice serve` before it spawns its engines.
if TYPE_CHECKING:
    from billing.config import BillingConfig
    from billing.reconcile import MeterDifference


def add_billing_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], database_url: Callable[[], str]
) -> None:
    """`database_url` is called only when a billing command runs (the embedded default makes its folder)."""
    billing = sub.add_parser("billing", help="usage billing with Stripe meters (docs/billing.md)")
    commands = billing.add_subparsers(dest="billing_command", required=True)
    relay = commands.add_parser("relay", help="send pending billing events to Stripe until stopped")
    relay.add_argument("--once", action="store_true", help="one pass, then exit")
    relay.set_defaults(func=lambda args, env: _run(_relay(database_url(), args.once)))
    rec = commands.add_parser("reconcile", help="compare Stripe's meter summaries with the ledger")
    rec.add_argument("--period", required=True,
                     help="2026-12 (a UTC month), 2026-12-01 (a UTC day) or START/END (ISO 8601)")
    rec.add_argument("--apply", action="store_true",
                     help="queue an adjustment event for usage Stripe did not count (the relay sends it)")
    rec.set_defaults(func=lambda args, env: _run(_reconcile(database_url(), args.period, args.apply)))


def _run(main: object) -> int:
    return asyncio.run(main)  # type: ignore[arg-type]


def _config() -> BillingConfig:
    from billing.config import BillingConfig

    config = BillingConfig.from_env()
    if not config.can_send:
        raise SystemExit(
            "billing needs STRIPE_API_KEY and at least one meter "
            "(SLUICE_BILLING_PROMPT_METER, SLUICE_BILLING_COMPLETION_METER)"
        )
    return config


async def _relay(database_url: str, once: bool) -> int:
    from billing.relay import BillingRelay
    from billing.stripe_meters import StripeMeters
    from tenants.db import create_engine, run_migrations, session_factory

    config = _config()
    engine = create_engine(database_url)
    await run_migrations(engine)
    meters = StripeMeters(config)
    relay = BillingRelay(session_factory(engine), config, meters)
    try:
        if once:
            result = await relay.run_once()
            print(f"sealed {result.sealed} events, sent {relay.sent}, claimed {result.claimed}", flush=True)
            return 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, relay.request_stop)
        print(f"billing relay {relay.relay_id} running", flush=True)
        await relay.run()
        return 0
    finally:
        await meters.close()
        await engine.dispose()


async def _reconcile(database_url: str, period: str, apply: bool) -> int:
    from billing.reconcile import parse_period, reconcile
    from billing.stripe_meters import StripeMeters
    from tenants.db import create_engine, run_migrations, session_factory

    config = _config()
    try:
        start, end = parse_period(period)
    except ValueError as exc:
        raise SystemExit(f"--period: {exc}") from None
    engine = create_engine(database_url)
    await run_migrations(engine)
    meters = StripeMeters(config)
    try:
        lines = await reconcile(session_factory(engine), config, meters, start, end, apply)
    finally:
        await meters.close()
        await engine.dispose()
    print(f"period {start.isoformat()} .. {end.isoformat()}")
    print(f"{'tenant':24} {'customer':20} {'meter':10} {'ledger':>12} {'in flight':>10} {'stripe':>12} "
          f"{'difference':>11}  action")
    for line in lines:
        print(_row(line))
    unsettled = [x for x in lines if x.difference and x.action != "adjustment queued"]
    return 1 if unsettled else 0


def _row(x: MeterDifference) -> str:
    return (f"{x.tenant_name[:24]:24} {x.customer[:20]:20} {x.meter:10} {x.ledger:>12} {x.in_flight:>10} "
            f"{x.stripe:>12} {x.difference:>11}  {x.action}")


if __name__ == "__main__":
    sys.exit("run through `sluice billing ...`")
