"""Queries over the tenant tables; one class per table, each bound to a session the caller owns."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import ColumnElement, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import AdminCredential, ApiKey, Tenant, UsageRecord


class TenantRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def add(self, tenant: Tenant) -> Tenant:
        self.session.add(tenant)
        await self.session.flush()
        return tenant

    async def get(self, tenant_id: str) -> Tenant | None:
        return await self.session.get(Tenant, tenant_id)

    async def by_name(self, name: str) -> Tenant | None:
        result = await self.session.execute(select(Tenant).where(Tenant.name == name))
        return result.scalar_one_or_none()

    async def list(self) -> Sequence[Tenant]:
        return (await self.session.execute(select(Tenant).order_by(Tenant.created_at))).scalars().all()

    async def delete(self, tenant: Tenant) -> None:
        # Keys go explicitly (not only by ON DELETE CASCADE) so it holds whatever the backend enforces.
        await self.session.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant.id))
        await self.session.delete(tenant)


class ApiKeyRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def add(self, key: ApiKey) -> ApiKey:
        self.session.add(key)
        await self.session.flush()
        return key

    async def get(self, key_id: str) -> ApiKey | None:
        return await self.session.get(ApiKey, key_id)

    async def for_tenant(self, tenant_id: str) -> Sequence[ApiKey]:
        query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
        return (await self.session.execute(query)).scalars().all()

    async def with_tenant_by_hash(self, key_hash: str) -> tuple[ApiKey, Tenant] | None:
        query = select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id)
        row = (await self.session.execute(query.where(ApiKey.key_hash == key_hash))).first()
        return None if row is None else (row[0], row[1])

    async def touch(self, last_used: dict[str, dt.datetime]) -> None:
        """Set last_used_at per key id (batched with usage writes, never on the request path)."""
        for key_id, when in last_used.items():
            await self.session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=when))


class UsageRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def add_many(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            await self.session.execute(insert(UsageRecord), rows)

    async def tokens_since(self, tenant_id: str, since: dt.datetime) -> int:
        total = UsageRecord.prompt_tokens + UsageRecord.completion_tokens
        query = select(func.coalesce(func.sum(total), 0)).where(
            UsageRecord.tenant_id == tenant_id, UsageRecord.created_at >= since
        )
        return int((await self.session.execute(query)).scalar_one())

    async def grouped(
        self, tenant_id: str, start: dt.datetime, end: dt.datetime, group_by: Literal["day", "model"]
    ) -> list[tuple[str, int, int, int]]:
        """(group, requests, prompt_tokens, completion_tokens) in [start, end), ordered by group."""
        group = self._day(self.session) if group_by == "day" else UsageRecord.model
        query = (
            select(
                group.label("g"),
                func.count(),
                func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
                func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
            )
            .where(
                UsageRecord.tenant_id == tenant_id,
                UsageRecord.created_at >= start,
                UsageRecord.created_at < end,
            )
            .group_by("g")
            .order_by("g")
        )
        rows = (await self.session.execute(query)).all()
        return [(str(g), int(n), int(p), int(c)) for g, n, p, c in rows]

    async def completed_latencies(
        self, tenant_id: str, start: dt.datetime, end: dt.datetime, limit: int
    ) -> list[tuple[dt.datetime, str, float | None, float]]:
        """(created_at, model, ttft_ms, latency_ms) of completed requests in [start, end), newest first."""
        query = (
            select(UsageRecord.created_at, UsageRecord.model, UsageRecord.ttft_ms, UsageRecord.latency_ms)
            .where(
                UsageRecord.tenant_id == tenant_id,
                UsageRecord.status == "ok",
                UsageRecord.created_at >= start,
                UsageRecord.created_at < end,
            )
            .order_by(UsageRecord.created_at.desc())
            .limit(limit)
        )
        rows = (await self.session.execute(query)).all()
        return [(t, str(m), None if f is None else float(f), float(n)) for t, m, f, n in rows]

    @staticmethod
    def _day(session: AsyncSession) -> ColumnElement[str]:
        if session.get_bind().dialect.name == "postgresql":
            return func.to_char(func.timezone("UTC", UsageRecord.created_at), "YYYY-MM-DD")
        return func.strftime("%Y-%m-%d", UsageRecord.created_at)  # SQLite stores UTC text


class AdminCredentialRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self) -> AdminCredential | None:
        return await self.session.get(AdminCredential, 1)

    async def add(self, key_hash: str) -> None:
        self.session.add(AdminCredential(id=1, key_hash=key_hash))
        await self.session.flush()
