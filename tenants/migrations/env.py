"""Alembic environment: runs on the connection `tenants.db.run_migrations` hands over.

Migrations only run programmatically (at app start and in tests), so there is
no alembic.ini and no offline mode.
"""

from __future__ import annotations

from alembic import context

from tenants.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through tenants.db.run_migrations(url)")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
