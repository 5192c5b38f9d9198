"""Who is calling: API keys to a `TenantContext`, and the admin key.

Key lookups are cached for `ttl_s` (1 s by default, positive and negative answers
alike), so a revocation, suspension or limit change reaches every replica within
that TTL plus one DB read, without a DB query per request. The replica that makes the
change forgets at once (`forget`), and a lookup that was already reading the database
when it did is not cached, so there a revoked key is refused on its next request. The cache is two bounded
LRU maps: keys that exist, and hashes that matched no key. A spray of random keys
only ever evicts other unknown hashes, never a known key.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ratelimit.base import TenantLimits
from tenants.errors import AuthenticationError, PermissionDeniedError
from tenants.keys import ADMIN_KEY_PREFIX, generate_key, hash_key, matches
from tenants.models import ApiKey, Tenant, TenantStatus
from tenants.repository import AdminCredentialRepository, ApiKeyRepository

log = logging.getLogger("sluice.tenants")


@dataclass(frozen=True)
class TenantContext:
    """The authenticated caller of one request."""

    tenant_id: str
    tenant_name: str
    key_id: str
    priority: int
    limits: TenantLimits
    monthly_token_budget: int | None
    weight: float = 1.0
    """Fair share relative to other tenants (`Tenant.weight`)."""


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
            tenant.id,
            tenant.name,
            key.id,
            tenant.priority,
            limits,
            tenant.monthly_token_budget,
            tenant.weight,
        )
        return cls(
            key.key_hash,
            context,
            tenant.status != TenantStatus.ACTIVE.value,
            key.revoked_at is not None,
            key.expires_at,
        )


V = TypeVar("V")


class _LRUCache(Generic[V]):
    """At most `capacity` entries, each valid for `ttl_s`; the least recently used goes first."""

    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def get(self, key: str) -> tuple[bool, V | None]:
        """(hit, value)."""
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if entry[0] <= self.clock():
            del self._entries[key]
            return False, None
        self._entries.move_to_end(key)
        return True, entry[1]

    def put(self, key: str, value: V) -> None:
        self._entries[key] = (self.clock() + self.ttl_s, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def discard(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class KeyCacheConfig:
    ttl_s: float = 1.0
    """How long a lookup is trusted; bounds how late a revocation takes effect (SLUICE_AUTH_CACHE_TTL_S)."""
    max_known: int = 50_000
    """Keys that exist (valid, revoked, expired or of a suspended tenant) kept in memory."""
    max_unknown: int = 10_000
    """Hashes that matched no key kept in memory; random keys evict only each other."""


class KeyAuthenticator:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        config: KeyCacheConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.config = config or KeyCacheConfig()
        self._known: _LRUCache[_KeyRecord] = _LRUCache(self.config.max_known, self.config.ttl_s, clock)
        self._unknown: _LRUCache[None] = _LRUCache(self.config.max_unknown, self.config.ttl_s, clock)
        self._loading: dict[str, asyncio.Future[_KeyRecord | None]] = {}
        self._generation = 0
        """Bumped by forget(): a read that started before it may hold what was just changed."""

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

    def forget(self, key_hash: str | None = None) -> None:
        """Drop what is cached of `key_hash` (of every key when None) after this replica changed
        it (revoked a key, suspended or changed a tenant): its next request reads the database."""
        self._generation += 1
        # A read in flight still answers its waiters, but later requests start a new one.
        if key_hash is None:
            self._known.clear()
            self._unknown.clear()
            self._loading.clear()
        else:
            self._known.discard(key_hash)
            self._unknown.discard(key_hash)
            self._loading.pop(key_hash, None)

    async def _record(self, key_hash: str) -> _KeyRecord | None:
        hit, record = self._known.get(key_hash)
        if hit:
            return record
        if self._unknown.get(key_hash)[0]:
            return None
        # One DB read per key per TTL however many requests arrive at once.
        pending = self._loading.get(key_hash)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[_KeyRecord | None] = asyncio.get_running_loop().create_future()
        self._loading[key_hash] = future
        generation = self._generation
        try:
            record = await self._load(key_hash)
            if generation != self._generation:
                pass  # forgotten meanwhile: what was read may predate the change
            elif record is None:
                self._known.discard(key_hash)
                self._unknown.put(key_hash, None)
            else:
                self._unknown.discard(key_hash)
                self._known.put(key_hash, record)
            future.set_result(record)
            return record
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            if self._loading.get(key_hash) is future:
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
