"""The tenant machinery one gateway process runs: database, authenticators, limiter, usage writer,
and with billing configured the billing outbox and relay (billing/).

Built from `Settings` at the edge and started/stopped by the app's lifespan.
Startup migrates the database (alembic upgrade head) and sets up the admin
key; shutdown flushes every usage record and refund before closing. The usage
writer's counters are exported on the app's Prometheus registry
(`UsageWriterCollector`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from billing.ledger import BillingOutbox
from billing.metrics import BillingRelayCollector
from billing.relay import BillingRelay
from billing.stripe_meters import StripeMeters
from gateway.admission import TenantGate
from gateway.settings import Settings
from ratelimit.base import FailMode, RateLimiter, lease_for
from tenants.auth import AdminAuthenticator, KeyAuthenticator, KeyCacheConfig
from tenants.db import create_engine, default_sqlite_url, run_migrations, session_factory
from tenants.report_limit import ReportLimiter
from tenants.service import TenantService, TenantSpec
from tenants.usage import MonthlyUsage, UsageWriter, UsageWriterConfig

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


class UsageWriterCollector(Collector):
    """The usage writer's counters as Prometheus metrics, read at scrape time."""

    def __init__(self, writer: UsageWriter) -> None:
        self.writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self.writer
        for name, doc, value in (
            ("sluice_usage_rows_written", "Usage records written to the database", w.written),
            (
                "sluice_usage_rows_rejected",
                "Usage records the database refused, isolated from their batch, logged and not written",
                w.rejected,
            ),
            (
                "sluice_usage_rows_overflowed",
                "Usage records dropped because the in-memory buffer was full (database down or far behind)",
                w.overflowed,
            ),
            (
                "sluice_usage_rows_lost",
                "Usage records still buffered when shutdown gave up on the database",
                w.lost,
            ),
            (
                "sluice_usage_write_failures",
                "Usage writes that found the database unavailable",
                w.failed_writes,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "sluice_usage_rows_buffered", "Usage records waiting to be written", value=w.buffered
        )


@dataclass
class Tenancy:
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    tenants: TenantService
    keys: KeyAuthenticator
    admin: AdminAuthenticator
    gate: TenantGate
    usage: UsageWriter
    reports: ReportLimiter
    registry: CollectorRegistry | None = None
    collectors: tuple[Collector, ...] = ()
    relay: BillingRelay | None = None  # with billing configured, SLUICE_BILLING_RELAY on

    @classmethod
    async def start(
        cls, settings: Settings, registry: CollectorRegistry | None = None
    ) -> tuple[Tenancy, FirstStartKeys | None]:
        """The running tenancy and, on a first start without SLUICE_ADMIN_KEY, the keys it made.
        With `registry`, the usage writer's counters are exported there until stop()."""
        engine = create_engine(database_url(settings))
        await run_migrations(engine)
        sessions = session_factory(engine)
        admin, generated = await AdminAuthenticator.setup(sessions, settings.admin_key)
        billing = settings.billing
        # The outbox is written whenever meters are named, relay or not: the ledger must not have gaps.
        outbox = BillingOutbox(list(billing.meters), billing.window_s) if billing.enabled else None
        usage = UsageWriter(
            sessions, UsageWriterConfig(flush_interval_s=settings.usage_flush_interval_s), outbox
        )
        usage.start()
        gate = TenantGate(create_limiter(settings), usage, MonthlyUsage(sessions))
        keys = KeyAuthenticator(sessions, KeyCacheConfig(ttl_s=settings.auth_cache_ttl_s))
        tenants = TenantService(sessions)
        first: FirstStartKeys | None = None
        if generated:
            tenant_key = None
            if not await tenants.list_tenants():
                tenant = await tenants.create_tenant(TenantSpec(name="default"))
                _, tenant_key = await tenants.create_key(tenant.id, "quickstart")
            first = FirstStartKeys(generated, tenant_key)
        tenancy = cls(engine, sessions, tenants, keys, admin, gate, usage, ReportLimiter())
        if billing.can_send and billing.relay:
            tenancy.relay = BillingRelay(sessions, billing, StripeMeters(billing))
            tenancy.relay.start()
        if registry is not None:
            tenancy.registry = registry
            tenancy.collectors = (UsageWriterCollector(usage),)
            if tenancy.relay is not None:
                tenancy.collectors += (BillingRelayCollector(tenancy.relay),)
            for collector in tenancy.collectors:
                registry.register(collector)
        return tenancy, first

    async def stop(self) -> None:
        await self.gate.close()  # refunds first: they may still be running
        await self.usage.close()
        if self.relay is not None:  # after the usage flush; what it has not sent waits in the outbox
            await self.relay.stop()
            await self.relay.meters.close()
        await self.gate.limiter.close()
        await self.engine.dispose()
        if self.registry is not None:
            for collector in self.collectors:
                self.registry.unregister(collector)
        u = self.usage
        if u.dropped:
            log.error(
                "usage records lost",
                extra={"rejected": u.rejected, "overflowed": u.overflowed, "lost": u.lost},
            )
