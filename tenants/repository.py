"""Queries over the tenant tables; one class per table, each bound to a session the caller owns."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Literal

from sqlalchemy import ColumnElement, and_, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.latency import QUANTILES, GroupRanks, nearest_rank
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

    async def latency_ranks(
        self,
        tenant_id: str,
        start: dt.datetime,
        end: dt.datetime,
        group_by: Literal["day", "model"],
        max_samples: int,
    ) -> tuple[list[GroupRanks], bool]:
        """TTFT and end-to-end latency at QUANTILES' nearest ranks, per group and overall (group None),
        over the newest `max_samples` completed requests in [start, end); and whether more were there."""
        completed = (
            UsageRecord.tenant_id == tenant_id,
            UsageRecord.status == "ok",
            UsageRecord.created_at >= start,
            UsageRecord.created_at < end,
        )
        group = self._day(self.session) if group_by == "day" else UsageRecord.model
        sample = (
            select(
                group.label("g"), UsageRecord.ttft_ms.label("ttft"), UsageRecord.latency_ms.label("latency")
            )
            .where(*completed)
            .order_by(UsageRecord.created_at.desc())
            .limit(max_samples)
            .subquery("sample")
        )
        if self.session.get_bind().dialect.name == "postgresql":
            ranks = await self._percentile_disc(sample)
        else:
            ranks = await self._ranked(sample)
        beyond = select(UsageRecord.id).where(*completed).limit(max_samples + 1).subquery()
        seen = int((await self.session.execute(select(func.count()).select_from(beyond))).scalar_one())
        return ranks, seen > max_samples

    async def _percentile_disc(self, sample: Any) -> list[GroupRanks]:
        """PostgreSQL: percentile_disc is the nearest-rank percentile (NULL TTFTs are skipped)."""
        k = len(QUANTILES)
        columns = [
            func.count(),
            *(func.percentile_disc(q / 100).within_group(sample.c.ttft) for q in QUANTILES),
            *(func.percentile_disc(q / 100).within_group(sample.c.latency) for q in QUANTILES),
        ]
        grouped = (await self.session.execute(select(sample.c.g, *columns).group_by(sample.c.g))).all()
        overall = (await self.session.execute(select(*columns))).one()
        rows: list[tuple[Any, ...]] = [(str(r[0]), *r[1:]) for r in grouped]
        if overall[0]:
            rows.append((None, *overall))
        return [GroupRanks(r[0], int(r[1]), tuple(r[2 : 2 + k]), tuple(r[2 + k :])) for r in rows]

    async def _ranked(self, sample: Any) -> list[GroupRanks]:
        """Elsewhere (SQLite): number each metric's values in order, per group and over all, and keep
        only the rows whose number is a nearest rank, ceil(q * n / 100)."""
        per_group = await self.session.execute(select(sample.c.g, func.count()).group_by(sample.c.g))
        sizes: dict[str | None, int] = {str(g): int(n) for g, n in per_group}
        if not sizes:
            return []
        sizes[None] = sum(sizes.values())
        counts: dict[tuple[str, str | None], int] = {}  # (metric, group) -> values; group None: all
        values: dict[tuple[str, str | None, int], float] = {}  # (metric, group, rank) -> value
        for metric in ("ttft", "latency"):
            value = sample.c[metric]
            ranked = (
                select(
                    sample.c.g,
                    value.label("v"),
                    func.row_number().over(partition_by=sample.c.g, order_by=value).label("rn"),
                    func.count().over(partition_by=sample.c.g).label("n"),
                    func.row_number().over(order_by=value).label("rn_all"),
                    func.count().over().label("n_all"),
                )
                .where(value.is_not(None))
                .subquery()
            )
            wanted = or_(
                *(self._is_rank(ranked.c.rn, ranked.c.n, q) for q in QUANTILES),
                *(self._is_rank(ranked.c.rn_all, ranked.c.n_all, q) for q in QUANTILES),
            )
            query = select(ranked.c.g, ranked.c.v, ranked.c.rn, ranked.c.n, ranked.c.rn_all, ranked.c.n_all)
            for g, v, rn, n, rn_all, n_all in await self.session.execute(query.where(wanted)):
                counts[(metric, str(g))], counts[(metric, None)] = int(n), int(n_all)
                values[(metric, str(g), int(rn))] = values[(metric, None, int(rn_all))] = float(v)

        def at_ranks(metric: str, group: str | None) -> tuple[float | None, ...]:
            n = counts.get((metric, group), 0)
            return tuple(values[(metric, group, nearest_rank(n, q))] if n else None for q in QUANTILES)

        return [GroupRanks(g, n, at_ranks("ttft", g), at_ranks("latency", g)) for g, n in sizes.items()]

    @staticmethod
    def _is_rank(rn: Any, n: Any, q: int) -> ColumnElement[bool]:
        """rn is ceil(q * n / 100), in integers: rn * 100 >= q * n > (rn - 1) * 100."""
        return and_(rn * 100 >= n * q, (rn - 1) * 100 < n * q)

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
