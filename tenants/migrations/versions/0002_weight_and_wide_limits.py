"""Fair-share weights; 64-bit per-minute limits and usage record ids on PostgreSQL.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

SQLite's INTEGER already holds 64 bits, so only PostgreSQL changes column types. Changing
them on SQLite would also mean rebuilding `tenants`, whose DROP (foreign keys on, inside
the migration's transaction) would cascade into `api_keys`.

On PostgreSQL, widening `usage_records.id` rewrites that table under an exclusive lock:
expect the upgrade to take a while on a large usage history.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_WIDENED = (("tenants", "requests_per_minute", True), ("tenants", "tokens_per_minute", True))


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float, nullable=False, server_default=sa.text("1.0")))
    if not _postgresql():
        return
    for table, column, nullable in _WIDENED:
        op.alter_column(
            table, column, type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=nullable
        )
    op.alter_column(
        "usage_records", "id", type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=False
    )
    # The serial's sequence keeps its own type; an INTEGER sequence would stop at 2^31 all the same.
    op.execute("ALTER SEQUENCE usage_records_id_seq AS bigint")


def downgrade() -> None:
    if _postgresql():
        op.execute("ALTER SEQUENCE usage_records_id_seq AS integer")
        op.alter_column(
            "usage_records", "id", type_=sa.Integer, existing_type=sa.BigInteger, existing_nullable=False
        )
        for table, column, nullable in _WIDENED:
            op.alter_column(
                table, column, type_=sa.Integer, existing_type=sa.BigInteger, existing_nullable=nullable
            )
    op.drop_column("tenants", "weight")
