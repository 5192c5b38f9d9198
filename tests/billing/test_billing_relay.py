"""The relay sends the ledger to Stripe (a stand-in, through the official SDK) exactly once, whatever
Stripe answers: Stripe's count equals the ledger, and every event is counted once."""

from __future__ import annotations

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


async def assert_stripe_equals_ledger(standin: RunningStandIn, sessions: Sessions, tenant_id: str) -> None:
    customer = await customer_of(sessions, tenant_id)
    for meter, name in ((PROMPT, PROMPT_METER), (COMPLETION, COMPLETION_METER)):
        assert standin.app.total(name, customer) == await ledger_tokens(sessions, tenant_id, meter) > 0
    sent = [e for e in await events(sessions) if e.tenant_id == tenant_id]
    assert sent and all(e.status == "sent" for e in sent)
    # each event counted once at Stripe, under its own identifier
    assert all(e.identifier in standin.app.events for e in sent)
    assert sum(standin.app.events[e.identifier].value for e in sent) == sum(e.value for e in sent)


def test_usage_reaches_stripe_once_per_window(db_url: str, stripe_standin: RunningStandIn) -> None:
    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin)
        tenant = await linked_tenant(sessions)
        await write_usage(sessions, cfg, tenant, 40)
        r = relay(sessions, cfg)
        await drain(r, sessions)
        await assert_stripe_equals_ledger(stripe_standin, sessions, tenant)
        # 4 windows x 2 meters: lines of many flushes aggregate into one event per tenant, meter, window
        assert len(await events(sessions)) == 8
        assert r.sent == 8 and not r.failures
        assert max(stripe_standin.app.executions.values()) == 1
        await r.meters.close()

    run(db_url, scenario)


def test_429_500_and_timeouts_are_retried_until_counted_once(
    db_url: str, stripe_standin: RunningStandIn
) -> None:
    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin, concurrency=1)
        tenant = await linked_tenant(sessions)
        await write_usage(sessions, cfg, tenant, 12)
        stripe_standin.app.inject("429", "500", "timeout", "429", "500", delay_s=1.5)
        r = relay(sessions, cfg)
        await drain(r, sessions)
        await assert_stripe_equals_ledger(stripe_standin, sessions, tenant)
        assert r.failures["rate_limited"] == 2 and r.failures["server_error"] >= 2
        assert r.failures["timeout"] == 1
        await r.meters.close()

    run(db_url, scenario)


def test_committed_then_500_is_not_counted_twice(db_url: str, stripe_standin: RunningStandIn) -> None:
    """Stripe stores the 500 for the idempotency key; the retry takes a new key and the identifier
    answers "already exists", which the relay counts as sent."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin, concurrency=1)
        tenant = await linked_tenant(sessions)
        await write_usage(sessions, cfg, tenant, 8)
        stripe_standin.app.inject("commit_then_500", "commit_then_500")
        r = relay(sessions, cfg)
        await drain(r, sessions)
        await assert_stripe_equals_ledger(stripe_standin, sessions, tenant)
        assert r.duplicates == 2 and stripe_standin.app.replays >= 2
        assert sum(stripe_standin.app.duplicates.values()) == 2
        assert sorted(e.key_generation for e in await events(sessions))[-2:] == [1, 1]
        await r.meters.close()

    run(db_url, scenario)


def test_backoff_doubles_to_its_cap_with_half_of_it_random() -> None:
    """Relays retrying together spread out: each wait lies in [ceiling / 2, ceiling], the ceiling
    doubling per attempt up to retry_max_s."""
    import random

    from billing.config import BillingConfig
    from billing.relay import BillingRelay

    cfg = BillingConfig(retry_initial_s=1.0, retry_max_s=8.0)
    r = BillingRelay(None, cfg, None, rng=random.Random(7))  # type: ignore[arg-type]
    for attempts, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        waits = [r._backoff_s(attempts) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 4  # jittered, not a fixed schedule
