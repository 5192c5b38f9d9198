"""The model registry: public model names, versions, alias generations, change log, tenant access.

Revision ID: 0003_model_registry
Revises: 0002
Create Date: 2026-12-01

New tables only (versions/tables.py describes them); nothing existing changes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_model_registry"
down_revision = "0002"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)
_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "registry_models",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
    )
    op.create_table(
        "registry_versions",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(100), sa.ForeignKey("registry_models.name", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("source", sa.String(1000), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("fingerprint", sa.String(40), nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
        sa.UniqueConstraint("model", "version", name="uq_registry_versions_model_version"),
    )
    op.create_table(
        "registry_generations",
        sa.Column("model", sa.String(100), sa.ForeignKey("registry_models.name", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("generation", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("weights", sa.JSON, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
    )
    op.create_table(
        "registry_changes",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(100), nullable=False),
        sa.Column("version", sa.String(64), nullable=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_index("ix_registry_changes_model", "registry_changes", ["model"])
    op.create_table(
        "registry_tenant_access",
        sa.Column("tenant_id", sa.String(36), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("model", sa.String(100), sa.ForeignKey("registry_models.name", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("version", sa.String(64), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("registry_tenant_access")
    op.drop_index("ix_registry_changes_model", "registry_changes")
    op.drop_table("registry_changes")
    op.drop_table("registry_generations")
    op.drop_table("registry_versions")
    op.drop_table("registry_models")
