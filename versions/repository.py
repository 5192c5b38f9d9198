"""Every read and write of the registry's rows; each write also appends to the change log.

Writes that depend on other rows (an alias naming versions, a version leaving service) first lock the
model's row (`SELECT ... FOR UPDATE` on PostgreSQL; SQLite has one writer anyway), so "set the alias
to v1" and "retire v1" cannot both succeed. The alias itself is a compare-and-set: the caller names
the generation it saw, and the new generation's primary key admits one writer only.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.models import Tenant, utcnow
from versions.errors import RegistryConflictError, UnknownModelError, UnknownTenantError
from versions.names import VersionState, version_id
from versions.tables import (
    RegistryChange,
    RegistryGeneration,
    RegistryModel,
    RegistryTenantAccess,
    RegistryVersion,
)


@dataclass(frozen=True)
class VersionRecord:
    model: str
    version: str
    source: str
    dtype: str
    state: VersionState
    fingerprint: str
    detail: str | None
    created_at: dt.datetime
    created_by: str
    updated_at: dt.datetime
    updated_by: str

    @property
    def id(self) -> str:
        return version_id(self.model, self.version)

    @classmethod
    def of(cls, row: RegistryVersion) -> VersionRecord:
        return cls(row.model, row.version, row.source, row.dtype, VersionState(row.state), row.fingerprint,
                   row.detail, row.created_at, row.created_by, row.updated_at, row.updated_by)


@dataclass(frozen=True)
class AliasRecord:
    model: str
    generation: int
    weights: dict[str, int]  # version -> percentage
    created_at: dt.datetime
    created_by: str

    @classmethod
    def of(cls, row: RegistryGeneration) -> AliasRecord:
        return cls(row.model, row.generation, dict(row.weights), row.created_at, row.created_by)


@dataclass(frozen=True)
class ChangeRecord:
    model: str
    version: str | None
    action: str
    detail: str
    actor: str
    created_at: dt.datetime


@dataclass(frozen=True)
class RegistrySnapshot:
    """The whole registry as one read saw it: what a replica routes and hosts by."""

    models: tuple[str, ...]
    versions: dict[str, VersionRecord]  # by version id
    aliases: dict[str, AliasRecord]  # by model: the newest generation
    # tenant id -> {model: pinned version or None}; a tenant absent here may use every model
    access: dict[str, dict[str, str | None]] = field(default_factory=dict)


def fingerprint(model: str, version: str, source: str, dtype: str, created: dt.datetime) -> str:
    digest = hashlib.sha256(f"{model}\0{version}\0{source}\0{dtype}\0{created.isoformat()}".encode()).hexdigest()
    return f"fp_{digest[:12]}"


class RegistryRepository:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    # ----- reads -------------------------------------------------------------------------

    async def snapshot(self) -> RegistrySnapshot:
        async with self.sessions() as s:
            models = (await s.scalars(select(RegistryModel.name).order_by(RegistryModel.name))).all()
            versions = (await s.scalars(select(RegistryVersion))).all()
            newest = (
                select(RegistryGeneration.model, func.max(RegistryGeneration.generation).label("g"))
                .group_by(RegistryGeneration.model).subquery()
            )
            aliases = (await s.scalars(select(RegistryGeneration).join(
                newest, (RegistryGeneration.model == newest.c.model) & (RegistryGeneration.generation == newest.c.g)
            ))).all()
            grants = (await s.scalars(select(RegistryTenantAccess))).all()
        access: dict[str, dict[str, str | None]] = {}
        for grant in grants:
            access.setdefault(grant.tenant_id, {})[grant.model] = grant.version
        return RegistrySnapshot(
            tuple(models),
            {r.id: r for r in map(VersionRecord.of, versions)},
            {a.model: AliasRecord.of(a) for a in aliases},
            access,
        )

    async def version(self, model: str, version: str) -> VersionRecord:
        async with self.sessions() as s:
            return VersionRecord.of(await _version_row(s, model, version))

    async def generation(self, model: str, generation: int) -> AliasRecord | None:
        async with self.sessions() as s:
            row = await s.get(RegistryGeneration, (model, generation))
            return AliasRecord.of(row) if row is not None else None

    async def changes(self, model: str, limit: int = 200) -> list[ChangeRecord]:
        async with self.sessions() as s:
            rows = (await s.scalars(
                select(RegistryChange).where(RegistryChange.model == model)
                .order_by(RegistryChange.id.desc()).limit(limit)
            )).all()
        return [ChangeRecord(r.model, r.version, r.action, r.detail, r.actor, r.created_at) for r in rows]

    # ----- writes ------------------------------------------------------------------------

    async def register(self, model: str, version: str, source: str, dtype: str, actor: str) -> VersionRecord:
        now = utcnow()
        row = RegistryVersion(
            model=model, version=version, source=source, dtype=dtype, state=VersionState.REGISTERED.value,
            fingerprint=fingerprint(model, version, source, dtype, now), created_at=now, created_by=actor,
            updated_at=now, updated_by=actor,
        )
        try:
            async with self.sessions() as s, s.begin():
                if await s.get(RegistryModel, model, with_for_update=True) is None:
                    s.add(RegistryModel(name=model, created_at=now, created_by=actor))
                    await s.flush()
                s.add(row)
                await s.flush()
                _log(s, model, version, "register", {"source": source, "dtype": dtype}, actor)
        except IntegrityError:
            raise RegistryConflictError(f"{version_id(model, version)} is registered already") from None
        return VersionRecord.of(row)

    async def set_state(
        self, model: str, version: str, state: VersionState, actor: str, *,
        expect: frozenset[VersionState], action: str, detail: str | None = None,
    ) -> VersionRecord:
        """Move a version to `state` if it is in one of `expect` now (else 409). Leaving service
        (draining, retired) is refused while the model's alias points at the version."""
        async with self.sessions() as s, s.begin():
            await _lock_model(s, model)
            row = await _version_row(s, model, version)
            current = VersionState(row.state)
            if current not in expect:
                raise RegistryConflictError(
                    f"{version_id(model, version)} is {current.value}; this needs it "
                    f"{' or '.join(sorted(e.value for e in expect))}"
                )
            if state in (VersionState.DRAINING, VersionState.RETIRED):
                alias = await _newest(s, model)
                if alias is not None and version in alias.weights:
                    raise RegistryConflictError(
                        f"the alias of {model} (generation {alias.generation}) points at {version}: "
                        "move the alias away first"
                    )
            row.state, row.detail = state.value, detail
            row.updated_at, row.updated_by = utcnow(), actor
            _log(s, model, version, action, {"state": state.value, **({"reason": detail} if detail else {})}, actor)
        return VersionRecord.of(row)

    async def write_alias(
        self, model: str, weights: dict[str, int], expected: int, actor: str, action: str
    ) -> AliasRecord:
        """Generation `expected + 1` with `weights`, if the newest generation is still `expected` (0:
        none yet) and every version named is ready; RegistryConflictError otherwise."""
        try:
            async with self.sessions() as s, s.begin():
                await _lock_model(s, model)
                newest = await _newest(s, model)
                current = newest.generation if newest is not None else 0
                if current != expected:
                    raise RegistryConflictError(
                        f"the alias of {model} is at generation {current}, not {expected}: read it again"
                    )
                for version in weights:
                    state = (await _version_row(s, model, version)).state
                    if state != VersionState.READY.value:
                        raise RegistryConflictError(
                            f"{version_id(model, version)} is {state}: only ready versions can take traffic"
                        )
                written = RegistryGeneration(model=model, generation=expected + 1, weights=weights,
                                             created_at=utcnow(), created_by=actor)
                s.add(written)
                await s.flush()
                _log(s, model, None, action, {"generation": expected + 1, "weights": weights,
                                             "previous": newest.weights if newest else {}}, actor)
        except IntegrityError:  # another writer took generation expected + 1 between our read and write
            raise RegistryConflictError(f"the alias of {model} changed meanwhile: read it again") from None
        return AliasRecord.of(written)

    async def release_unreferenced(self, model: str, actor: str) -> list[str]:
        """Move to `draining` every ready version of `model` that some older alias generation named and
        neither of the newest two (the alias, and what a rollback would restore) nor any tenant's pin
        names any more; returns those versions. A version no alias has named yet (deployed, awaiting
        its switch) stays. Under the model's lock, so an alias naming it cannot be written meanwhile."""
        async with self.sessions() as s, s.begin():
            await _lock_model(s, model)
            history = (await s.scalars(
                select(RegistryGeneration).where(RegistryGeneration.model == model)
                .order_by(RegistryGeneration.generation.desc())
            )).all()
            kept = {v for g in history[:2] for v in g.weights}
            pins = (await s.scalars(select(RegistryTenantAccess.version).where(RegistryTenantAccess.model == model))).all()
            kept |= {v for v in pins if v is not None}
            named_before = {v for g in history[2:] for v in g.weights}
            released = []
            for version in sorted(named_before - kept):
                row = await _version_row(s, model, version)
                if row.state != VersionState.READY.value:
                    continue
                row.state, row.detail = VersionState.DRAINING.value, "no alias references it any more"
                row.updated_at, row.updated_by = utcnow(), actor
                _log(s, model, version, "release", {"state": row.state, "since_generation": history[0].generation},
                     actor)
                released.append(version)
        return released

    async def tenant_access(self, tenant_id: str) -> dict[str, str | None] | None:
        async with self.sessions() as s:
            rows = (await s.scalars(
                select(RegistryTenantAccess).where(RegistryTenantAccess.tenant_id == tenant_id)
            )).all()
        return {r.model: r.version for r in rows} or None

    async def set_tenant_access(
        self, tenant_id: str, models: dict[str, str | None] | None, actor: str
    ) -> dict[str, str | None] | None:
        """Replace the tenant's model list (None: every model, unpinned). Each model must be registered
        and each pinned version too (UnknownModelError); an unknown tenant is UnknownTenantError."""
        async with self.sessions() as s, s.begin():
            if await s.get(Tenant, tenant_id) is None:
                raise UnknownTenantError(f"no tenant with id {tenant_id!r}")
            old = (await s.scalars(
                select(RegistryTenantAccess).where(RegistryTenantAccess.tenant_id == tenant_id)
            )).all()
            for row in old:
                await s.delete(row)
                if row.model not in (models or {}):
                    _log(s, row.model, None, "tenant_access", {"tenant": tenant_id, "removed": True}, actor)
            await s.flush()
            for model, version in (models or {}).items():
                await _lock_model(s, model)
                if version is not None:
                    await _version_row(s, model, version)
                s.add(RegistryTenantAccess(tenant_id=tenant_id, model=model, version=version, created_at=utcnow(),
                                           created_by=actor))
                _log(s, model, version, "tenant_access", {"tenant": tenant_id, "pinned": version}, actor)
        return models or None

    async def log_refusal(self, model: str, version: str, action: str, reason: str, actor: str) -> None:
        async with self.sessions() as s, s.begin():
            _log(s, model, version, action, {"reason": reason}, actor)


async def _lock_model(s: AsyncSession, model: str) -> RegistryModel:
    row = await s.get(RegistryModel, model, with_for_update=True)
    if row is None:
        raise UnknownModelError(f"no model named {model!r} is registered")
    return row


async def _version_row(s: AsyncSession, model: str, version: str) -> RegistryVersion:
    row = await s.scalar(
        select(RegistryVersion).where(RegistryVersion.model == model, RegistryVersion.version == version)
    )
    if row is None:
        raise UnknownModelError(f"no version {version_id(model, version)!r} is registered")
    return row


async def _newest(s: AsyncSession, model: str) -> AliasRecord | None:
    row = await s.scalar(
        select(RegistryGeneration).where(RegistryGeneration.model == model)
        .order_by(RegistryGeneration.generation.desc()).limit(1)
    )
    return AliasRecord.of(row) if row is not None else None


def _log(s: AsyncSession, model: str, version: str | None, action: str, detail: dict[str, object], actor: str) -> None:
    s.add(RegistryChange(model=model, version=version, action=action, detail=json.dumps(detail, sort_keys=True),
                         actor=actor, created_at=utcnow()))
