"""The billing tables, on the tenants' metadata (one schema, one migration history).

    usage_records ──(same transaction)──> billing_lines ──(sealed by a relay)──> billing_events ──> Stripe
      one per request         one per tenant, meter, window and flush      one per tenant, meter, window
                                                                           (and per late batch of lines)

A line is immutable once written; sealing sets its `event_id`, once. An event's `value` is the sum of
its lines, so the ledger and what is sent to Stripe can always be compared line by line.

Event states (an event is never deleted):

    pending ──sent (Stripe's 200, or "identifier already exists")──> sent
       └──refused for good, or still failing when Stripe's windows close──> dead ──reconciled──> adjusted
"""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import BigInteger, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from tenants.models import Base, UTCDateTime, utcnow


class EventStatus(enum.StrEnum):
    PENDING = "pending"
    SENT = "sent"
    DEAD = "dead"
    ADJUSTED = "adjusted"  # dead, and covered since by a reconciliation adjustment


class EventKind(enum.StrEnum):
    USAGE = "usage"  # sealed from ledger lines
    ADJUSTMENT = "adjustment"  # sent by `sluice billing reconcile --apply`: no lines


_ID = BigInteger().with_variant(Integer, "sqlite")  # SQLite's rowid must be spelled INTEGER


class BillingLine(Base):
    __tablename__ = "billing_lines"
    __table_args__ = (
        Index("ix_billing_lines_unsealed", "event_id", "window_start"),
        Index("ix_billing_lines_tenant_window", "tenant_id", "window_start"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(36))
    meter: Mapped[str] = mapped_column(String(16))  # PROMPT or COMPLETION
    window_start: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    value: Mapped[int] = mapped_column(BigInteger)
    event_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # None: not sealed yet
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class BillingEvent(Base):
    __tablename__ = "billing_events"
    __table_args__ = (
        Index("ix_billing_events_due", "status", "next_attempt_at"),
        Index("ix_billing_events_tenant_window", "tenant_id", "window_start"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    # Stripe's `identifier` (unique over >= 24 h there, forever here); derived from the ledger.
    identifier: Mapped[str] = mapped_column(String(100), unique=True)
    kind: Mapped[str] = mapped_column(String(16), default=EventKind.USAGE.value)
    tenant_id: Mapped[str] = mapped_column(String(36))
    meter: Mapped[str] = mapped_column(String(16))
    event_name: Mapped[str] = mapped_column(String(100))  # the Stripe meter's, when sealed
    stripe_customer_id: Mapped[str] = mapped_column(String(255))  # the tenant's, when sealed
    window_start: Mapped[dt.datetime] = mapped_column(UTCDateTime)  # sent as the event's timestamp
    value: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default=EventStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Bumped when Stripe replays a stored 5xx for our idempotency key: the next attempt uses a fresh
    # key and the identifier alone de-duplicates (see billing/relay.py).
    key_generation: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    claimed_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    first_attempt_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(500), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    sent_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)

    @property
    def idempotency_key(self) -> str:
        return self.identifier if not self.key_generation else f"{self.identifier}~{self.key_generation}"
