"""Joins the two heads that branched from 0002: billing (0003_billing) and the model registry
(0003_model_registry). They touch disjoint tables, so the merge changes nothing.

Revision ID: 0004
Revises: 0003_billing, 0003_model_registry
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0004"
down_revision = ("0003_billing", "0003_model_registry")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
