"""Tenant administration, key authentication, usage writing and the admin key, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import secrets
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.auth import AdminAuthenticator, KeyAuthenticator, KeyCacheConfig
from tenants.db import create_engine, run_migrations, session_factory
from tenants.errors import (
    AuthenticationError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
)
from tenants.keys import KEY_PREFIX, hash_key
from tenants.models import AdminCredential, ApiKey, UsageRecord
from tenants.service import TenantService, TenantSpec
from tenants.usage import MonthlyUsage, UsageEvent, UsageWriter, UsageWriterConfig

Sessions = async_sessionmaker[AsyncSession]


def run(db_url: str, scenario: Callable[[Sessions], Awaitable[None]]) -> None:
    async def main() -> None:
        engine = create_engine(db_url)
        await run_migrations(engine)
        try:
            await scenario(session_factory(engine))
        finally:
            await engine.dispose()

    asyncio.run(main())


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def statements(sessions: Sessions, needle: str) -> Iterator[list[str]]:
    """The SQL statements containing `needle` that reach the database meanwhile."""
    seen: list[str] = []
    engine = sessions.kw["bind"].sync_engine

    def listen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if needle in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", listen)


def test_tenant_crud_and_unique_names(db_url: str) -> None:
    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        name = unique("acme")
        tenant = await service.create_tenant(TenantSpec(name=name, priority=0, requests_per_minute=5))
        assert (tenant.priority, tenant.requests_per_minute, tenant.status, tenant.weight) == (
            0,
            5,
            "active",
            1.0,
        )
        with pytest.raises(ConflictError):
            await service.create_tenant(TenantSpec(name=name))
        assert tenant.id in {t.id for t in await service.list_tenants()}
        updated = await service.update_tenant(tenant.id, {"status": "suspended", "tokens_per_minute": None})
        assert (updated.status, updated.tokens_per_minute, updated.requests_per_minute) == (
            "suspended",
            None,
            5,
        )
        assert (await service.get_tenant(tenant.id)).status == "suspended"
        assert (await service.update_tenant(tenant.id, {"weight": 2.5})).weight == 2.5
        assert (await service.get_tenant(tenant.id)).weight == 2.5
        await service.delete_tenant(tenant.id)
        with pytest.raises(NotFoundError):
            await service.get_tenant(tenant.id)
        with pytest.raises(NotFoundError):
            await service.create_key(tenant.id, "k")

    run(db_url, scenario)


def test_keys_are_stored_hashed_and_authenticate(db_url: str) -> None:
    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        tenant = await service.create_tenant(
            TenantSpec(name=unique("keys"), priority=2, max_concurrent=3, weight=0.5)
        )
        key, secret = await service.create_key(tenant.id, "laptop")
        assert secret.startswith("sk-sluice-") and len(secret) > 40
        assert key.prefix == secret[: len(key.prefix)] and len(key.prefix) >= 12
        async with sessions() as session:
            stored = await session.get(ApiKey, key.id)
        assert stored is not None and stored.key_hash == hash_key(secret) and secret not in stored.key_hash

        auth = KeyAuthenticator(
            sessions, KeyCacheConfig(ttl_s=0.0)
        )  # no cache: every check hits the database
        caller = await auth.authenticate(secret)
        assert (caller.tenant_id, caller.key_id, caller.priority, caller.weight) == (
            tenant.id,
            key.id,
            2,
            0.5,
        )
        assert caller.limits.max_concurrent == 3
        for bad in (None, "", "sk-sluice-nope", secret + "x"):
            with pytest.raises(AuthenticationError):
                await auth.authenticate(bad)

        await service.update_tenant(tenant.id, {"status": "suspended"})
        with pytest.raises(PermissionDeniedError):
            await auth.authenticate(secret)
        await service.update_tenant(tenant.id, {"status": "active"})
        await auth.authenticate(secret)

        await service.revoke_key(key.id)
        with pytest.raises(AuthenticationError, match="revoked"):
            await auth.authenticate(secret)
        assert [k.revoked_at is not None for k in await service.list_keys(tenant.id)] == [True]

        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        _, expired = await service.create_key(tenant.id, "old", expires_at=past)
        with pytest.raises(AuthenticationError, match="expired"):
            await auth.authenticate(expired)

    run(db_url, scenario)


def test_key_cache_serves_within_ttl_then_sees_revocation(db_url: str) -> None:
    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        tenant = await service.create_tenant(TenantSpec(name=unique("cache")))
        key, secret = await service.create_key(tenant.id, "k")
        clock = FakeClock()
        auth = KeyAuthenticator(sessions, KeyCacheConfig(ttl_s=1.0), clock=clock)
        with statements(sessions, "api_keys") as lookups:
            await asyncio.gather(*(auth.authenticate(secret) for _ in range(20)))
        assert len(lookups) == 1  # one DB read, shared by all 20
        await service.revoke_key(key.id)
        clock.now += 0.9
        await auth.authenticate(secret)  # still cached: accepted for at most the TTL
        clock.now += 0.1
        with pytest.raises(AuthenticationError):
            await auth.authenticate(secret)

    run(db_url, scenario)


def test_the_replica_that_revokes_forgets_at_once_even_a_read_already_in_flight(db_url: str) -> None:
    """Before: a lookup that read the key just before the revocation cached it for a full TTL
    after, so the console's 'revoked' sign-out waited on timing (seen failing in CI)."""

    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        tenant = await service.create_tenant(TenantSpec(name=unique("forget")))
        key, secret = await service.create_key(tenant.id, "k")
        auth = KeyAuthenticator(sessions, KeyCacheConfig(ttl_s=3600.0), clock=FakeClock())
        await auth.authenticate(secret)
        await service.revoke_key(key.id)
        auth.forget(key.key_hash)
        with pytest.raises(AuthenticationError, match="revoked"):
            await auth.authenticate(secret)

        # A read that started before the change answers its own caller but is not cached.
        other, other_secret = await service.create_key(tenant.id, "k2")
        read_started, change_made = asyncio.Event(), asyncio.Event()
        load = auth._load

        async def slow_load(key_hash: str) -> Any:
            found = await load(key_hash)
            read_started.set()
            await change_made.wait()
            return found

        auth._load = slow_load  # type: ignore[method-assign]
        in_flight = asyncio.create_task(auth.authenticate(other_secret))
        await read_started.wait()
        await service.revoke_key(other.id)
        auth.forget(other.key_hash)
        change_made.set()
        await in_flight  # it read the key before the revocation
        auth._load = load  # type: ignore[method-assign]
        with pytest.raises(AuthenticationError, match="revoked"):
            await auth.authenticate(other_secret)

        # Suspending a tenant forgets every key.
        _, fresh_secret = await service.create_key(tenant.id, "k3")
        await auth.authenticate(fresh_secret)
        await service.update_tenant(tenant.id, {"status": "suspended"})
        auth.forget()
        with pytest.raises(PermissionDeniedError):
            await auth.authenticate(fresh_secret)

    run(db_url, scenario)


def test_a_spray_of_unknown_keys_never_evicts_a_known_one(db_url: str) -> None:
    """Before: the 50,000th distinct key cleared the whole cache, known keys included, so a spray
    of random keys sent every real caller to the database."""

    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        tenant = await service.create_tenant(TenantSpec(name=unique("spray")))
        _, secret = await service.create_key(tenant.id, "k")
        config = KeyCacheConfig(ttl_s=3600.0, max_known=10, max_unknown=50)
        auth = KeyAuthenticator(sessions, config, clock=FakeClock())
        await auth.authenticate(secret)
        sprayed = [KEY_PREFIX + secrets.token_urlsafe(32) for _ in range(500)]
        for key in sprayed:
            with pytest.raises(AuthenticationError):
                await auth.authenticate(key)
        with statements(sessions, "api_keys") as lookups:
            assert (await auth.authenticate(secret)).tenant_id == tenant.id
            for key in sprayed[-50:]:  # the newest unknown hashes are remembered too
                with pytest.raises(AuthenticationError):
                    await auth.authenticate(key)
        assert lookups == []
        with statements(sessions, "api_keys") as lookups, pytest.raises(AuthenticationError):
            await auth.authenticate(sprayed[0])  # the oldest unknown one was evicted
        assert len(lookups) == 1

    run(db_url, scenario)


def test_monthly_usage_is_one_query_per_tenant_however_many_ask(db_url: str) -> None:
    """Before: every request arriving after the total went stale ran its own month-long SUM."""

    async def scenario(sessions: Sessions) -> None:
        tenant = str(uuid.uuid4())
        async with sessions.begin() as session:
            session.add(
                UsageRecord(
                    request_id="r",
                    tenant_id=tenant,
                    model="m",
                    prompt_tokens=7,
                    completion_tokens=5,
                    latency_ms=1.0,
                    status="ok",
                )
            )
        clock = FakeClock()
        monthly = MonthlyUsage(sessions, refresh_s=2.0, clock=clock)
        with statements(sessions, "sum(") as sums:
            assert await asyncio.gather(*(monthly.used(tenant) for _ in range(50))) == [12] * 50
            assert len(sums) == 1
            monthly.add(tenant, 3)  # recorded here, not yet in the database
            clock.now += 1.9
            assert await asyncio.gather(*(monthly.used(tenant) for _ in range(50))) == [15] * 50
            assert len(sums) == 1
            clock.now += 0.1  # stale: re-read once, by whichever request comes first
            assert await asyncio.gather(*(monthly.used(tenant) for _ in range(50))) == [12] * 50
            assert len(sums) == 2

    run(db_url, scenario)


def test_ids_that_cannot_exist_and_datetimes_beyond_utc_are_client_errors(db_url: str) -> None:
    """Before (PostgreSQL): a NUL in an id was sent to the database, which refused it (500); an
    expiry or report bound whose UTC leaves year 9999 overflowed on every backend (500)."""

    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        tenant = await service.create_tenant(TenantSpec(name=unique("edges")))
        for bad_id in ("\x00", "x\x00y", "a" * 37):
            with pytest.raises(NotFoundError):
                await service.get_tenant(bad_id)
            with pytest.raises(NotFoundError):
                await service.revoke_key(bad_id)
        far = dt.datetime(9999, 12, 31, 23, 0, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
        early = dt.datetime(1, 1, 1, 1, 0, tzinfo=dt.timezone(dt.timedelta(hours=5)))
        with pytest.raises(InvalidInputError) as refused:
            await service.create_key(tenant.id, "k", expires_at=far)
        assert refused.value.param == "expires_at"
        with pytest.raises(InvalidInputError):
            await service.usage(tenant.id, early, None, "day")
        with pytest.raises(InvalidInputError):
            await service.latency(tenant.id, None, far, "day")

    run(db_url, scenario)


def test_usage_writer_batches_flushes_on_close_and_reports(db_url: str) -> None:
    async def scenario(sessions: Sessions) -> None:
        service = TenantService(sessions)
        tenant = await service.create_tenant(TenantSpec(name=unique("usage"), monthly_token_budget=1000))
        key, _ = await service.create_key(tenant.id, "k")
        # A long interval and a big batch: only close() can write these rows.
        writer = UsageWriter(sessions, UsageWriterConfig(batch_size=10_000, flush_interval_s=60.0))
        writer.start()
        for i in range(250):
            model = "a" if i % 2 else "b"
            writer.record(UsageEvent(f"r{i}", tenant.id, key.id, model, 3, i % 7, 1.0, 2.0, "ok"))
        assert await _count(sessions, tenant.id) == 0
        await writer.close()
        assert await _count(sessions, tenant.id) == 250 and writer.dropped == 0

        expected = {m: sum(3 + i % 7 for i in range(250) if ("a" if i % 2 else "b") == m) for m in "ab"}
        by_model = await service.usage(tenant.id, None, None, "model")
        assert {g.group: g.total_tokens for g in by_model.groups} == expected
        assert {g.group: g.requests for g in by_model.groups} == {"a": 125, "b": 125}
        by_day = await service.usage(tenant.id, None, None, "day")
        assert [g.group for g in by_day.groups] == [dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")]
        assert by_day.groups[0].total_tokens == sum(expected.values())
        tomorrow = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
        later = await service.usage(tenant.id, tomorrow, tomorrow + dt.timedelta(days=1), "day")
        assert later.groups == []
        assert await MonthlyUsage(sessions).used(tenant.id) == sum(expected.values())
        assert (await service.list_keys(tenant.id))[0].last_used_at is not None

    run(db_url, scenario)


def test_admin_key_is_generated_once_and_stored_hashed(db_url: str) -> None:
    async def scenario(sessions: Sessions) -> None:
        async with sessions.begin() as session:  # a fresh deployment for this test
            await session.execute(AdminCredential.__table__.delete())
        first, generated = await AdminAuthenticator.setup(sessions, None)
        assert generated is not None and first.is_admin(generated)
        again, none = await AdminAuthenticator.setup(sessions, None)
        assert none is None and again.is_admin(generated) and not again.is_admin(generated + "x")
        async with sessions() as session:
            stored = await session.get(AdminCredential, 1)
        assert stored is not None and stored.key_hash == hash_key(generated)
        configured, none = await AdminAuthenticator.setup(sessions, "my-admin-key")
        assert none is None and configured.is_admin("my-admin-key") and not configured.is_admin(generated)

    run(db_url, scenario)


async def _count(sessions: Sessions, tenant_id: str) -> int:
    async with sessions() as session:
        query = select(func.count()).select_from(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
        return int((await session.execute(query)).scalar_one())
