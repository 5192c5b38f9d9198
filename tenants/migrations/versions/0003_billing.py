"""Usage billing: a tenant's Stripe customer, the billing outbox (lines and events).

Revision ID: 0003_billing
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_billing"
down_revision = "0002"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)
_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.add_column("tenants", sa.Column("stripe_customer_id", sa.String(255), nullable=True))
    op.create_table(
        "billing_lines",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("meter", sa.String(16), nullable=False),
        sa.Column("window_start", _TS, nullable=False),
        sa.Column("value", sa.BigInteger, nullable=False),
        sa.Column("event_id", sa.BigInteger, nullable=True),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_index("ix_billing_lines_unsealed", "billing_lines", ["event_id", "window_start"])
    op.create_index("ix_billing_lines_tenant_window", "billing_lines", ["tenant_id", "window_start"])
    op.create_table(
        "billing_events",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("identifier", sa.String(100), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("meter", sa.String(16), nullable=False),
        sa.Column("event_name", sa.String(100), nullable=False),
        sa.Column("stripe_customer_id", sa.String(255), nullable=False),
        sa.Column("window_start", _TS, nullable=False),
        sa.Column("value", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("key_generation", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", _TS, nullable=False),
        sa.Column("claimed_by", sa.String(64), nullable=True),
        sa.Column("lease_until", _TS, nullable=True),
        sa.Column("first_attempt_at", _TS, nullable=True),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("sent_at", _TS, nullable=True),
    )
    op.create_index("ix_billing_events_due", "billing_events", ["status", "next_attempt_at"])
    op.create_index("ix_billing_events_tenant_window", "billing_events", ["tenant_id", "window_start"])


def downgrade() -> None:
    op.drop_table("billing_events")
    op.drop_table("billing_lines")
    op.drop_column("tenants", "stripe_customer_id")
