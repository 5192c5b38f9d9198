"""The stand-in behaves as Stripe documents it, through the official SDK: validation errors naming the
parameter, identifier de-duplication, idempotency-key replay and conflicts, summaries, cancellations.
And the relay dead-letters what Stripe refuses for good instead of retrying it."""

from __future__ import annotations

import time

import pytest
import stripe
from harness import PROMPT_METER, Sessions, config, drain, events, linked_tenant, relay, run, write_usage
from sqlalchemy.ext.asyncio import AsyncEngine
from stripe_standin import RunningStandIn


def client(standin: RunningStandIn) -> stripe.StripeClient:
    return stripe.StripeClient("sk_test_x", base_addresses={"api": standin.base_url}, max_network_retries=0)


def test_meter_events_as_stripe_documents_them(stripe_standin: RunningStandIn) -> None:
    c = client(stripe_standin)
    events = c.v1.billing.meter_events
    ok = events.create({"event_name": PROMPT_METER, "identifier": "id-1",
                        "payload": {"stripe_customer_id": "cus_A", "value": "25"}})
    assert ok.object == "billing.meter_event" and ok.identifier == "id-1" and ok.payload["value"] == "25"

    for params, param in (
        ({"payload": {"stripe_customer_id": "cus_A", "value": "1"}}, "event_name"),
        ({"event_name": PROMPT_METER, "payload": {"value": "1"}}, "payload[stripe_customer_id]"),
        ({"event_name": PROMPT_METER, "payload": {"stripe_customer_id": "cus_A", "value": "x"}}, "payload[value]"),
        ({"event_name": PROMPT_METER, "payload": {"stripe_customer_id": "cus_A", "value": "1"},
          "timestamp": int(time.time()) - 36 * 86400}, "timestamp"),
        ({"event_name": PROMPT_METER, "payload": {"stripe_customer_id": "cus_A", "value": "1"},
          "identifier": "x" * 101}, "identifier"),
    ):
        with pytest.raises(stripe.InvalidRequestError) as refused:
            events.create(params)  # type: ignore[arg-type]
        assert refused.value.http_status == 400 and refused.value.param == param

    with pytest.raises(stripe.InvalidRequestError, match="already exists with identifier id-1"):
        events.create({"event_name": PROMPT_METER, "identifier": "id-1",
                       "payload": {"stripe_customer_id": "cus_A", "value": "25"}})

    params = {"event_name": PROMPT_METER, "identifier": "id-2", "payload": {"stripe_customer_id": "cus_A", "value": "5"}}
    first = events.create(params, {"idempotency_key": "k-2"})  # type: ignore[arg-type]
    replay = events.create(params, {"idempotency_key": "k-2"})  # type: ignore[arg-type]
    assert replay.identifier == first.identifier and stripe_standin.app.replays == 1
    with pytest.raises(stripe.IdempotencyError):
        events.create({**params, "identifier": "id-3"}, {"idempotency_key": "k-2"})  # type: ignore[arg-type]

    meter = c.v1.billing.meters.list().data
    meter_id = next(m.id for m in meter if m.event_name == PROMPT_METER)
    now = int(time.time()) // 60 * 60
    window = {"customer": "cus_A", "start_time": now - 3600, "end_time": now + 60}
    assert c.v1.billing.meters.event_summaries.list(meter_id, window).data[0].aggregated_value == 30
    with pytest.raises(stripe.InvalidRequestError) as unaligned:
        c.v1.billing.meters.event_summaries.list(meter_id, {**window, "start_time": now - 3599})
    assert unaligned.value.param == "start_time"

    cancel = c.v1.billing.meter_event_adjustments.create(
        {"event_name": PROMPT_METER, "type": "cancel", "cancel": {"identifier": "id-2"}}
    )
    assert cancel.object == "billing.meter_event_adjustment" and cancel.cancel.identifier == "id-2"
    assert c.v1.billing.meters.event_summaries.list(meter_id, window).data[0].aggregated_value == 25
    with pytest.raises(stripe.InvalidRequestError):
        c.v1.billing.meter_event_adjustments.create(
            {"event_name": PROMPT_METER, "type": "cancel", "cancel": {"identifier": "nope"}}
        )
    with pytest.raises(stripe.AuthenticationError):
        stripe.StripeClient("", base_addresses={"api": stripe_standin.base_url}).v1.billing.meters.list()


def test_usage_older_than_stripe_accepts_is_dead_lettered_at_once(stripe_standin: RunningStandIn, tmp_path: object) -> None:
    """Usage older than Stripe's 35 days (a tenant linked late) is dead-lettered without a send: Stripe
    would refuse it, so retrying could only burn attempts. Reconciliation reports it."""

    async def scenario(_: AsyncEngine, sessions: Sessions) -> None:
        cfg = config(stripe_standin)
        tenant = await linked_tenant(sessions)
        await write_usage(sessions, cfg, tenant, 4, minutes_ago=36 * 24 * 60)  # older than Stripe accepts
        r = relay(sessions, cfg)
        await drain(r, sessions)
        dead = await events(sessions)
        assert dead and all(e.status == "dead" and e.attempts == 1 for e in dead)
        assert r.failures["too_old"] == len(dead) and not stripe_standin.app.events
        await r.meters.close()

    run(f"sqlite:///{tmp_path}/d.db", scenario)
