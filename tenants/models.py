"""The tenant schema as SQLAlchemy ORM classes; the migrations in `tenants/migrations/` create it.

Priority tiers (`Tenant.priority`, lower is more important; it becomes
`GenerationRequest.priority` and orders work in the engine):

    0  premium    interactive, scheduled first
    1  standard   the default
    2  batch      background work, scheduled last

`Tenant.stripe_customer_id` links a tenant to its Stripe customer; only linked tenants'
usage is sent to Stripe (docs/billing.md).

`Tenant.weight` is the tenant's fair-share weight relative to the others (default 1.0);
it reaches `TenantContext.weight`.

Column types bound what the admin API accepts (`tenants/bounds.py`): per-minute limits
and the monthly budget are BIGINT, so their range is the schema's, not a 32-bit column's.
"""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

PREMIUM, STANDARD, BATCH = 0, 1, 2


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return None if value is None else value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class TenantStatus(enum.StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    priority: Mapped[int] = mapped_column(Integer, default=STANDARD)
    # None = unlimited, for every limit below.
    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))
    # The tenant's Stripe customer (cus_...); None: its usage is recorded but not billed (billing/).
    stripe_customer_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.ACTIVE.value)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(32))
    # SHA-256 hex of the secret; the secret itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class UsageRecord(Base):
    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_tenant_time", "tenant_id", "created_at"),)

    # 64-bit on PostgreSQL: a busy deployment passes 2^31 rows. SQLite's INTEGER PRIMARY KEY is
    # 64-bit already and must stay spelled INTEGER to remain the rowid.
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(String(80))
    # No foreign keys: usage outlives deleted tenants and keys (billing history).
    tenant_id: Mapped[str] = mapped_column(String(36))
    key_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class AdminCredential(Base):
    """The generated admin key's hash; one row (id 1) so concurrent first starts cannot both win."""

    __tablename__ = "admin_credentials"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
