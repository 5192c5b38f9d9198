"""Tenants: who may call the service and how much (tenants, API keys, admin key, usage records).

Persistence is SQLAlchemy 2 async over SQLite (embedded default) or PostgreSQL,
with the schema owned by the Alembic migrations in `tenants/migrations/`.
The gateway uses the services here; nothing here knows about HTTP.
"""
