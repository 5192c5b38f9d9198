"""The model registry's rows on SQLite and PostgreSQL: the alias is a compare-and-set on its generation,
only ready versions take traffic, a version an alias points at cannot leave service, every change is
logged with its admin."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tenants.db import create_engine, run_migrations, session_factory
from tenants.service import TenantService, TenantSpec
from versions.errors import RegistryConflictError, UnknownModelError, UnknownTenantError
from versions.names import VersionState
from versions.repository import RegistryRepository

S = VersionState


async def _repo(url: str) -> tuple[RegistryRepository, object]:
    engine = create_engine(url)
    await run_migrations(engine)
    return RegistryRepository(session_factory(engine)), engine


async def _ready(repo: RegistryRepository, model: str, version: str) -> None:
    await repo.register(model, version, f"/models/{version}.gguf", "auto", "alice")
    await repo.set_state(model, version, S.LOADING, "alice", expect=frozenset({S.REGISTERED}), action="deploy")
    await repo.set_state(model, version, S.READY, "alice", expect=frozenset({S.LOADING}), action="ready")


def test_alias_generations_are_compare_and_set(db_url: str) -> None:
    async def scenario() -> None:
        repo, engine = await _repo(db_url)
        model = f"m-{uuid.uuid4().hex[:8]}"
        try:
            await _ready(repo, model, "v1")
            await _ready(repo, model, "v2")
            first = await repo.write_alias(model, {"v1": 100}, 0, "alice", "alias")
            assert first.generation == 1
            # Two admins who both saw generation 1: exactly one writes generation 2.
            results = await asyncio.gather(
                repo.write_alias(model, {"v2": 100}, 1, "alice", "alias"),
                repo.write_alias(model, {"v1": 50, "v2": 50}, 1, "bob", "alias"),
                return_exceptions=True,
            )
            won = [r for r in results if not isinstance(r, BaseException)]
            lost = [r for r in results if isinstance(r, BaseException)]
            assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], RegistryConflictError), results
            snapshot = await repo.snapshot()
            assert snapshot.aliases[model].generation == 2
            assert snapshot.aliases[model].weights == won[0].weights  # type: ignore[union-attr]
            with pytest.raises(RegistryConflictError):  # stale: generation 1 is no longer the newest
                await repo.write_alias(model, {"v1": 100}, 1, "carol", "alias")
            assert (await repo.generation(model, 1)).weights == {"v1": 100}  # type: ignore[union-attr]
        finally:
            await engine.dispose()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_only_ready_versions_take_traffic_and_referenced_ones_cannot_leave(db_url: str) -> None:
    async def scenario() -> None:
        repo, engine = await _repo(db_url)
        model = f"m-{uuid.uuid4().hex[:8]}"
        try:
            await _ready(repo, model, "v1")
            await repo.register(model, "v2", "/models/v2", "bfloat16", "alice")
            with pytest.raises(RegistryConflictError, match="registered"):
                await repo.write_alias(model, {"v2": 100}, 0, "alice", "alias")
            with pytest.raises(UnknownModelError):
                await repo.write_alias(model, {"v9": 100}, 0, "alice", "alias")
            with pytest.raises(RegistryConflictError, match="already"):
                await repo.register(model, "v1", "/elsewhere", "auto", "bob")
            await repo.write_alias(model, {"v1": 100}, 0, "alice", "alias")
            with pytest.raises(RegistryConflictError, match="points at v1"):
                await repo.set_state(model, "v1", S.DRAINING, "bob", expect=frozenset({S.READY}), action="retire")
            with pytest.raises(RegistryConflictError, match="is registered"):  # not from this state
                await repo.set_state(model, "v2", S.READY, "bob", expect=frozenset({S.LOADING}), action="ready")
            await repo.set_state(model, "v2", S.LOADING, "bob", expect=frozenset({S.REGISTERED}), action="deploy")
            await repo.set_state(model, "v2", S.READY, "bob", expect=frozenset({S.LOADING}), action="ready")
            await repo.write_alias(model, {"v2": 100}, 1, "bob", "alias")
            retired = await repo.set_state(model, "v1", S.DRAINING, "bob", expect=frozenset({S.READY}),
                                           action="retire")
            assert retired.state == S.DRAINING and retired.updated_by == "bob"
            snapshot = await repo.snapshot()
            assert {v.version: v.state for v in snapshot.versions.values() if v.model == model} == {
                "v1": S.DRAINING, "v2": S.READY,
            }
            assert snapshot.versions[f"{model}@v1"].fingerprint != snapshot.versions[f"{model}@v2"].fingerprint
            changes = await repo.changes(model)
            assert [c.action for c in changes] == [
                "retire", "alias", "ready", "deploy", "alias", "register", "ready", "deploy", "register",
            ]
            assert [c.actor for c in changes][:2] == ["bob", "bob"] and changes[-1].actor == "alice"
        finally:
            await engine.dispose()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_a_tenant_model_list_is_stored_checked_and_cleared(db_url: str) -> None:
    async def scenario() -> None:
        repo, engine = await _repo(db_url)
        model = f"m-{uuid.uuid4().hex[:8]}"
        try:
            tenant = await TenantService(repo.sessions).create_tenant(TenantSpec(name=f"t-{uuid.uuid4().hex[:8]}"))
            await _ready(repo, model, "v1")
            with pytest.raises(UnknownTenantError):
                await repo.set_tenant_access("no-such-tenant", {model: None}, "alice")
            with pytest.raises(UnknownModelError):
                await repo.set_tenant_access(tenant.id, {model: "v9"}, "alice")
            with pytest.raises(UnknownModelError):
                await repo.set_tenant_access(tenant.id, {"unregistered": None}, "alice")
            assert await repo.tenant_access(tenant.id) is None  # the refused calls left nothing
            await repo.set_tenant_access(tenant.id, {model: "v1"}, "alice")
            assert (await repo.snapshot()).access[tenant.id] == {model: "v1"}
            await repo.set_tenant_access(tenant.id, None, "bob")
            assert await repo.tenant_access(tenant.id) is None
            assert tenant.id not in (await repo.snapshot()).access
            assert [c.action for c in await repo.changes(model)][:2] == ["tenant_access", "tenant_access"]
        finally:
            await engine.dispose()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_a_version_no_alias_references_any_more_is_released(db_url: str) -> None:
    async def scenario() -> None:
        repo, engine = await _repo(db_url)
        model = f"m-{uuid.uuid4().hex[:8]}"
        try:
            tenant = await TenantService(repo.sessions).create_tenant(TenantSpec(name=f"t-{uuid.uuid4().hex[:8]}"))
            for version in ("v1", "v2", "v3", "v4"):
                await _ready(repo, model, version)
            await repo.write_alias(model, {"v1": 100}, 0, "alice", "alias")
            await repo.write_alias(model, {"v2": 100}, 1, "alice", "alias")
            # v1 is what a rollback restores; v3 and v4 were never named (deployed, awaiting a switch).
            assert await repo.release_unreferenced(model, "alice") == []
            await repo.set_tenant_access(tenant.id, {model: "v1"}, "alice")
            await repo.write_alias(model, {"v3": 100}, 2, "alice", "alias")
            assert await repo.release_unreferenced(model, "alice") == []  # v1: a tenant is pinned to it
            await repo.set_tenant_access(tenant.id, None, "alice")
            assert await repo.release_unreferenced(model, "alice") == ["v1"]
            await repo.write_alias(model, {"v3": 100}, 3, "bob", "alias")
            assert await repo.release_unreferenced(model, "bob") == ["v2"]
            states = {v.version: v.state for v in (await repo.snapshot()).versions.values() if v.model == model}
            assert states == {"v1": S.DRAINING, "v2": S.DRAINING, "v3": S.READY, "v4": S.READY}
            assert (await repo.changes(model))[0].action == "release"
            # Unloaded everywhere, it may be deployed again.
            await repo.set_state(model, "v1", S.REGISTERED, "bob", expect=frozenset({S.DRAINING}), action="unloaded")
            await repo.set_state(model, "v1", S.LOADING, "bob", expect=frozenset({S.REGISTERED}), action="deploy")
        finally:
            await engine.dispose()  # type: ignore[attr-defined]

    asyncio.run(scenario())
