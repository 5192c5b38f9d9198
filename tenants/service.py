"""Tenant administration: tenants, their keys and usage reports, one transaction per call.

Inputs arrive already shape-checked (the admin API's schemas bound every field to
its column, see tenants/bounds.py); this layer enforces what needs the database
(existence, unique names, key ownership) and what a schema cannot say: an id that
cannot exist is not found without a query, a datetime is converted to UTC or
refused (400) when UTC leaves years 1..9999.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.bounds import could_be_id, is_plain_text, utc
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.keys import display_prefix, generate_key, hash_key
from tenants.latency import MAX_SAMPLES, LatencyReport
from tenants.models import STANDARD, ApiKey, Tenant, TenantStatus, utcnow
from tenants.repository import ApiKeyRepository, TenantRepository, UsageRepository

# Fields PATCH may change; anything else in the mapping is a programming error.
MUTABLE_FIELDS = frozenset(
    {
        "name",
        "priority",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "monthly_token_budget",
        "weight",
        "status",
        "stripe_customer_id",
    }
)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    priority: int = STANDARD
    requests_per_minute: int | None = 60
    tokens_per_minute: int | None = 100_000
    max_concurrent: int | None = 8
    monthly_token_budget: int | None = None
    weight: float = 1.0
    stripe_customer_id: str | None = None  # None: usage recorded, not billed through Stripe


@dataclass(frozen=True)
class UsageGroup:
    group: str  # a day (YYYY-MM-DD, UTC) or a model id
    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageReport:
    tenant_id: str
    start: dt.datetime
    end: dt.datetime
    group_by: Literal["day", "model"]
    groups: list[UsageGroup]


class TenantService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    # -- tenants ---------------------------------------------------------------------------------

    async def create_tenant(self, spec: TenantSpec) -> Tenant:
        tenant = Tenant(
            id=str(uuid.uuid4()),
            name=spec.name,
            priority=spec.priority,
            requests_per_minute=spec.requests_per_minute,
            tokens_per_minute=spec.tokens_per_minute,
            max_concurrent=spec.max_concurrent,
            monthly_token_budget=spec.monthly_token_budget,
            weight=spec.weight,
            stripe_customer_id=spec.stripe_customer_id,
            status=TenantStatus.ACTIVE.value,
        )
        async with self.sessions.begin() as session:
            repo = TenantRepository(session)
            if await repo.by_name(spec.name) is not None:
                raise ConflictError(f"A tenant named '{spec.name}' already exists")
            try:
                return await repo.add(tenant)
            except IntegrityError:  # a concurrent create with the same name won the race
                raise ConflictError(f"A tenant named '{spec.name}' already exists") from None

    async def list_tenants(self) -> Sequence[Tenant]:
        async with self.sessions() as session:
            return await TenantRepository(session).list()

    async def get_tenant(self, tenant_id: str) -> Tenant:
        async with self.sessions() as session:
            return await _tenant(session, tenant_id)

    async def update_tenant(self, tenant_id: str, changes: Mapping[str, Any]) -> Tenant:
        unknown = set(changes) - MUTABLE_FIELDS
        if unknown:
            raise ValueError(f"not mutable: {sorted(unknown)}")
        try:
            async with self.sessions.begin() as session:
                tenant = await _tenant(session, tenant_id)
                for field, value in changes.items():
                    setattr(tenant, field, value)
                tenant.updated_at = utcnow()
                await session.flush()
                return tenant
        except IntegrityError:
            raise ConflictError(f"A tenant named '{changes.get('name')}' already exists") from None

    async def delete_tenant(self, tenant_id: str) -> None:
        async with self.sessions.begin() as session:
            await TenantRepository(session).delete(await _tenant(session, tenant_id))

    # -- keys ------------------------------------------------------------------------------------

    async def create_key(
        self, tenant_id: str, name: str, expires_at: dt.datetime | None = None
    ) -> tuple[ApiKey, str]:
        """The key record and its secret; the secret exists only in this return value."""
        if expires_at is not None:
            if expires_at.tzinfo is None:
                raise InvalidInputError(
                    "expires_at needs a timezone, e.g. 2030-01-01T00:00:00Z", "expires_at"
                )
            expires_at = _utc(expires_at, "expires_at")
        secret = generate_key()
        key = ApiKey(
            id=str(uuid.uuid4()),
            tenant_id=tenant_id,
            name=name,
            prefix=display_prefix(secret),
            key_hash=hash_key(secret),
            created_at=utcnow(),
            expires_at=expires_at,
        )
        async with self.sessions.begin() as session:
            await _tenant(session, tenant_id)
            return await ApiKeyRepository(session).add(key), secret

    async def list_keys(self, tenant_id: str) -> Sequence[ApiKey]:
        async with self.sessions() as session:
            await _tenant(session, tenant_id)
            return await ApiKeyRepository(session).for_tenant(tenant_id)

    async def revoke_key(self, key_id: str) -> ApiKey:
        async with self.sessions.begin() as session:
            key = await ApiKeyRepository(session).get(key_id) if could_be_id(key_id) else None
            if key is None:
                raise NotFoundError(f"No API key with id {_shown(key_id)}")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            return key

    # -- usage -----------------------------------------------------------------------------------

    async def usage(
        self,
        tenant_id: str,
        start: dt.datetime | None,
        end: dt.datetime | None,
        group_by: Literal["day", "model"],
    ) -> UsageReport:
        """Usage in [start, end); defaults: the current calendar month (UTC) up to now."""
        start, end = _window(start, end)
        async with self.sessions() as session:
            await _tenant(session, tenant_id)
            rows = await UsageRepository(session).grouped(tenant_id, start, end, group_by)
        return UsageReport(tenant_id, start, end, group_by, [UsageGroup(*row) for row in rows])

    async def latency(
        self,
        tenant_id: str,
        start: dt.datetime | None,
        end: dt.datetime | None,
        group_by: Literal["day", "model"],
        max_samples: int = MAX_SAMPLES,
    ) -> LatencyReport:
        """TTFT and end-to-end percentiles of the newest `max_samples` completed requests in
        [start, end), computed by the database; defaults as usage()."""
        start, end = _window(start, end)
        async with self.sessions() as session:
            await _tenant(session, tenant_id)
            ranks, truncated = await UsageRepository(session).latency_ranks(
                tenant_id, start, end, group_by, max_samples
            )
        return LatencyReport.of(tenant_id, start, end, group_by, ranks, truncated)


def month_start(now: dt.datetime) -> dt.datetime:
    return now.astimezone(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def report_window(start: dt.datetime | None, end: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    """[start, end) of a report (usage, latency, billing), in UTC: see _window."""
    return _window(start, end)


def _window(start: dt.datetime | None, end: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    """[start, end) of a report, in UTC; defaults: the current calendar month (UTC) up to now.
    A bare date/time is read as UTC, like the rest of the API."""
    now = utcnow()
    start = _utc(start, "start") if start else month_start(now)
    end = _utc(end, "end") if end else now + dt.timedelta(seconds=1)
    if start >= end:
        raise InvalidInputError("start must be before end", "start")
    return start, end


def _utc(value: dt.datetime, param: str) -> dt.datetime:
    try:
        return utc(value)
    except OverflowError:
        raise InvalidInputError(
            f"{param} is out of range: in UTC it must fall in years 1 to 9999", param
        ) from None


def _shown(identifier: str) -> str:
    """An id for an error message: quoted as given when printable, else Python-escaped."""
    return (
        f"'{identifier}'" if is_plain_text(identifier) and len(identifier) <= 100 else ascii(identifier[:100])
    )


async def _tenant(session: AsyncSession, tenant_id: str) -> Tenant:
    tenant = await TenantRepository(session).get(tenant_id) if could_be_id(tenant_id) else None
    if tenant is None:
        raise NotFoundError(f"No tenant with id {_shown(tenant_id)}")
    return tenant
