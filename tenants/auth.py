"""Who is calling: API keys to a `TenantContext`, and the admin key.

Key lookups are cached for `cache_ttl_s` (1 s by default, positive and
negative answers alike), so a revocation, suspension or limit change reaches
every replica within that TTL plus one DB read, without a DB query per request.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ratelimit.base import TenantLimits
from tenants.errors import AuthenticationError, PermissionDeniedError
from tenants.keys import ADMIN_KEY_PREFIX, generate_key, hash_key, matches
from tenants.models import ApiKey, Tenant, TenantStatus
from tenants.repository import AdminCredentialRepository, ApiKeyRepository

log = logging.getLogger("sluice.tenants")

_MAX_CACHED = 50_000  # bound memory if someone sprays random keys at us


@dataclass(frozen=True)
class TenantContext:
    """The authenticated caller of one request."""

    tenant_id: str
    tenant_name: str
    key_id: str
    priority: int
    limits: TenantLimits
    monthly_token_budget: int | None


@dataclass(frozen=True)
class _KeyRecord:
    key_hash: str
    context: TenantContext
    suspended: bool
    revoked: bool
    expires_at: dt.datetime | None

    @classmethod
    def of(cls, key: ApiKey, tenant: Tenant) -> _KeyRecord:
        limits = TenantLimits(tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent)
        context = TenantContext(
            tenant.id, tenant.name, key.id, tenant.priority, limits, tenant.monthly_token_budget
        )
        return cls(
            key.key_hash,
            context,
            tenant.status != TenantStatus.ACTIVE.value,
            key.revoked_at is not None,
            key.expires_at,
        )


class KeyAuthenticator:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], cache_ttl_s: float = 1.0) -> None:
        self.sessions = sessions
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, _KeyRecord | None]] = {}
        self._loading: dict[str, asyncio.Future[_KeyRecord | None]] = {}

    async def authenticate(self, key: str | None) -> TenantContext:
        """The caller behind `key`, or AuthenticationError (401) / PermissionDeniedError (403)."""
        if not key:
            raise AuthenticationError("Missing API key: send 'Authorization: Bearer <key>'")
        key_hash = hash_key(key)
        record = await self._record(key_hash)
        # The lookup was by hash; comparing again in constant time costs nothing and keeps a
        # cache or index oddity from ever turning into a timing signal.
        if record is None or not matches(key, record.key_hash):
            raise AuthenticationError("Incorrect API key provided")
        if record.revoked:
            raise AuthenticationError("This API key has been revoked")
        if record.expires_at is not None and record.expires_at <= dt.datetime.now(dt.UTC):
            raise AuthenticationError("This API key has expired")
        if record.suspended:
            raise PermissionDeniedError(f"Tenant '{record.context.tenant_name}' is suspended")
        return record.context

    async def _record(self, key_hash: str) -> _KeyRecord | None:
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is not None and cached[0] > now:
            return cached[1]
        # One DB read per key per TTL however many requests arrive at once.
        pending = self._loading.get(key_hash)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[_KeyRecord | None] = asyncio.get_running_loop().create_future()
        self._loading[key_hash] = future
        try:
            record = await self._load(key_hash)
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            self._cache[key_hash] = (time.monotonic() + self.cache_ttl_s, record)
            future.set_result(record)
            return record
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            del self._loading[key_hash]

    async def _load(self, key_hash: str) -> _KeyRecord | None:
        async with self.sessions() as session:
            found = await ApiKeyRepository(session).with_tenant_by_hash(key_hash)
        return None if found is None else _KeyRecord.of(*found)


class AdminAuthenticator:
    """Checks the admin key against its hash; the key itself is never kept."""

    def __init__(self, key_hash: str) -> None:
        self.key_hash = key_hash

    def is_admin(self, key: str | None) -> bool:
        return key is not None and matches(key, self.key_hash)

    @classmethod
    async def setup(
        cls, sessions: async_sessionmaker[AsyncSession], configured: str | None
    ) -> tuple[AdminAuthenticator, str | None]:
        """The admin authenticator and, on the very first start without SLUICE_ADMIN_KEY, the newly
        generated key (the caller prints it once; only its hash is stored).

        A configured key wins over a stored one, so setting SLUICE_ADMIN_KEY rotates a leaked key."""
        if configured:
            return cls(hash_key(configured)), None
        async with sessions.begin() as session:
            stored = await AdminCredentialRepository(session).get()
        if stored is not None:
            return cls(stored.key_hash), None
        key = generate_key(ADMIN_KEY_PREFIX)
        try:
            async with sessions.begin() as session:
                await AdminCredentialRepository(session).add(hash_key(key))
        except IntegrityError:  # another replica generated one first: use theirs, print nothing
            async with sessions.begin() as session:
                winner = await AdminCredentialRepository(session).get()
            assert winner is not None
            return cls(winner.key_hash), None
        return cls(hash_key(key)), key
