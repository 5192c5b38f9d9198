"""The tenant machinery one gateway process runs: database, authenticators, limiter, usage writer.

Built from `Settings` at the edge and started/stopped by the app's lifespan.
Startup migrates the database (alembic upgrade head) and sets up the admin
key; shutdown flushes every usage record and refund before closing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission import TenantGate
from gateway.settings import Settings
from ratelimit.base import FailMode, RateLimiter, lease_for
from tenants.auth import AdminAuthenticator, KeyAuthenticator
from tenants.db import create_engine, default_sqlite_url, run_migrations, session_factory
from tenants.service import TenantService, TenantSpec
from tenants.usage import MonthlyUsage, UsageWriter

log = logging.getLogger("sluice.gateway")


def database_url(settings: Settings) -> str:
    return settings.database_url or default_sqlite_url(settings.data_dir)


def create_limiter(settings: Settings) -> RateLimiter:
    # Imported here: the backends (redis) load only when tenancy is on.
    from ratelimit.registry import create_rate_limiter

    return create_rate_limiter(
        settings.redis_url,
        FailMode(settings.ratelimit_fail_mode),
        timeout_s=settings.ratelimit_timeout_s,
        lease_s=lease_for(settings.stream_timeout_s),  # no request outlives its stream timeout
    )


@dataclass(frozen=True)
class FirstStartKeys:
    """Secrets made on the very first start of an embedded deployment, to be shown exactly once."""

    admin_key: str
    # A "default" tenant's key, made only when the database has no tenant yet, so that the
    # quickstart's curl works without a trip through the admin API first.
    tenant_key: str | None


@dataclass
class Tenancy:
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    tenants: TenantService
    keys: KeyAuthenticator
    admin: AdminAuthenticator
    gate: TenantGate
    usage: UsageWriter

    @classmethod
    async def start(cls, settings: Settings) -> tuple[Tenancy, FirstStartKeys | None]:
        """The running tenancy and, on a first start without SLUICE_ADMIN_KEY, the keys it made."""
        engine = create_engine(database_url(settings))
        await run_migrations(engine)
        sessions = session_factory(engine)
        admin, generated = await AdminAuthenticator.setup(sessions, settings.admin_key)
        usage = UsageWriter(sessions, flush_interval_s=settings.usage_flush_interval_s)
        usage.start()
        gate = TenantGate(create_limiter(settings), usage, MonthlyUsage(sessions))
        keys = KeyAuthenticator(sessions, cache_ttl_s=settings.auth_cache_ttl_s)
        tenants = TenantService(sessions)
        first: FirstStartKeys | None = None
        if generated:
            tenant_key = None
            if not await tenants.list_tenants():
                tenant = await tenants.create_tenant(TenantSpec(name="default"))
                _, tenant_key = await tenants.create_key(tenant.id, "quickstart")
            first = FirstStartKeys(generated, tenant_key)
        return cls(engine, sessions, tenants, keys, admin, gate, usage), first

    async def stop(self) -> None:
        await self.gate.close()  # refunds first: they may still be running
        await self.usage.close()
        await self.gate.limiter.close()
        await self.engine.dispose()
        if self.usage.dropped:
            log.error("usage records lost", extra={"count": self.usage.dropped})
