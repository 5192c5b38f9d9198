"""Wire format of the billing views: /admin/billing (the relay's state) and a tenant's billed usage."""

from __future__ import annotations

import datetime as dt
from typing import Literal

import msgspec

from billing.reports import BilledDay
from billing.repository import RelayState


class BilledDayOut(msgspec.Struct, kw_only=True):
    day: str  # YYYY-MM-DD (UTC)
    meter: str  # "prompt" or "completion"
    sent: int  # tokens Stripe counted
    pending: int  # in an event the relay has not sent yet
    unsealed: int  # window still open, or the tenant not linked to a Stripe customer
    dead: int  # given up on; reconciliation bills it
    adjusted: int  # given up on, then billed by a reconciliation adjustment

    @classmethod
    def of(cls, d: BilledDay) -> BilledDayOut:
        return cls(day=d.day, meter=d.meter, **d.tokens)


class BilledOut(msgspec.Struct, kw_only=True):
    tenant_id: str
    start: dt.datetime
    end: dt.datetime
    data: list[BilledDayOut]
    object: Literal["billed_usage"] = "billed_usage"


class EventCount(msgspec.Struct):
    events: int
    tokens: int


class DeadEventOut(msgspec.Struct, kw_only=True):
    identifier: str
    tenant_id: str
    meter: str
    window_start: dt.datetime
    value: int
    attempts: int
    last_error: str | None


class RelayStateOut(msgspec.Struct, kw_only=True):
    """The billing outbox and relay: events per status, lag, the newest dead-lettered events."""

    enabled: bool  # meters configured: usage is written to the outbox
    relay_running: bool  # this gateway runs a relay
    events: dict[str, EventCount]
    unsealed_lines: int
    unlinked_lines: int
    oldest_pending_at: dt.datetime | None
    oldest_unsealed_window: dt.datetime | None
    dead: list[DeadEventOut]
    object: Literal["billing_relay"] = "billing_relay"

    @classmethod
    def of(cls, s: RelayState, enabled: bool, relay_running: bool) -> RelayStateOut:
        statuses = ("pending", "sent", "dead", "adjusted")
        return cls(
            enabled=enabled,
            relay_running=relay_running,
            events={k: EventCount(*s.events.get(k, (0, 0))) for k in statuses},
            unsealed_lines=s.unsealed_lines,
            unlinked_lines=s.unlinked_lines,
            oldest_pending_at=s.oldest_pending_at,
            oldest_unsealed_window=s.oldest_unsealed_window,
            dead=[
                DeadEventOut(
                    identifier=e.identifier, tenant_id=e.tenant_id, meter=e.meter, window_start=e.window_start,
                    value=e.value, attempts=e.attempts, last_error=e.last_error,
                )
                for e in s.dead
            ],
        )
