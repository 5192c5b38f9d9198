"""The model registry's admin API: register, deploy, alias, roll back, retire, and what happened.

Handlers translate between the wire (`gateway.version_schemas`) and `versions.service`; the admin
guard is the `admin` dependency. `x-sluice-actor` names the person behind the admin key in the change
log (default "admin"). docs/versions.md walks through a release.
"""

from __future__ import annotations

from typing import Annotated

from litestar import Request, get, post, put
from litestar.di import NamedDependency
from litestar.params import FromHeader, FromPath, HeaderParameter, JSONBody

from gateway.auth import ADMIN_SECURITY
from gateway.model_registry import ModelRegistry
from gateway.openapi import error_responses
from gateway.version_schemas import (
    AliasOut,
    AliasUpdate,
    AppliedOut,
    ChangeOut,
    ChangesOut,
    ModelOut,
    ModelsOut,
    Rollback,
    TenantModels,
    VersionCreate,
    VersionMetricsOut,
    VersionOut,
)
from observability.hub import Observability
from observability.version_view import version_figures
from versions.errors import NoHostError, UnknownModelError
from versions.names import check_model_name, version_id

Actor = FromHeader[Annotated[str | None, HeaderParameter(
    name="x-sluice-actor", max_length=200, required=False, description="who makes the change, for the change log"
)]]
_TAGS = ["models"]


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry | None = request.app.state.get("registry")
    if registry is None:
        raise NoHostError("the model registry is not running yet")
    return registry


def _actor(actor: str | None) -> str:
    return (actor or "").strip() or "admin"


async def _model_out(registry: ModelRegistry, name: str) -> ModelOut:
    snapshot = await registry.sync.repo.snapshot()
    if name not in snapshot.models:
        raise UnknownModelError(f"no model named {name!r} is registered")
    hosted = registry.hosted()
    alias = snapshot.aliases.get(name)
    applied = registry.sync.router.table.aliases.get(name)
    versions = sorted((v for v in snapshot.versions.values() if v.model == name), key=lambda v: v.created_at)
    return ModelOut(
        name=name,
        alias=AliasOut.of(alias) if alias is not None else None,
        applied=AppliedOut.of(applied) if applied is not None else None,
        versions=[VersionOut.of(v, hosted) for v in versions],
    )


@get("/admin/registry", security=ADMIN_SECURITY, tags=_TAGS, responses=error_responses(401, 403))
async def list_registry(request: Request, admin: NamedDependency[None]) -> ModelsOut:
    """Every registered model: its alias in the database, what this replica routes by, its versions."""
    registry = _registry(request)
    snapshot = await registry.sync.repo.snapshot()
    return ModelsOut([await _model_out(registry, name) for name in snapshot.models])


@get("/admin/models/{name:str}", security=ADMIN_SECURITY, tags=_TAGS, responses=error_responses(400, 401, 403, 404))
async def get_model(request: Request, name: FromPath[str], admin: NamedDependency[None]) -> ModelOut:
    return await _model_out(_registry(request), check_model_name(name))


@post(
    "/admin/models/{name:str}/versions", status_code=201, security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403, 408, 409, 413),
)
async def register_version(
    request: Request, name: FromPath[str], data: JSONBody[VersionCreate], admin: NamedDependency[None],
    actor: Actor = None,
) -> VersionOut:
    """Registers a version (state `registered`); the model name is created with its first version."""
    registry = _registry(request)
    record = await registry.service.register(name, data.version, data.source, data.dtype, _actor(actor))
    return VersionOut.of(record, registry.hosted())


@post(
    "/admin/models/{name:str}/versions/{version:str}/deploy", status_code=200, security=ADMIN_SECURITY,
    tags=_TAGS, responses=error_responses(400, 401, 403, 404, 409, 422),
)
async def deploy_version(
    request: Request, name: FromPath[str], version: FromPath[str], admin: NamedDependency[None], actor: Actor = None,
) -> VersionOut:
    """Loads and warms the version on this replica (the others follow); answers once it serves here.
    422 with the reason as `code` (missing_source, unsupported_architecture, over_budget,
    invalid_source, load_failed) when it cannot: then nothing that serves has changed."""
    registry = _registry(request)
    record = await registry.service.deploy(check_model_name(name), version, _actor(actor))
    return VersionOut.of(record, registry.hosted())


@put(
    "/admin/models/{name:str}/alias", security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403, 404, 408, 409, 413),
)
async def set_alias(
    request: Request, name: FromPath[str], data: JSONBody[AliasUpdate], admin: NamedDependency[None],
    actor: Actor = None,
) -> AliasOut:
    """Writes generation `generation + 1` if the newest is still `generation` (else 409: read it again).
    Every version named must be ready."""
    registry = _registry(request)
    return AliasOut.of(await registry.service.set_alias(name, dict(data.weights), data.generation, _actor(actor)))


@post(
    "/admin/models/{name:str}/rollback", status_code=200, security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403, 404, 408, 409, 413),
)
async def rollback(
    request: Request, name: FromPath[str], data: JSONBody[Rollback], admin: NamedDependency[None],
    actor: Actor = None,
) -> AliasOut:
    """The weights of the generation before the newest become a new generation."""
    registry = _registry(request)
    return AliasOut.of(await registry.service.rollback(check_model_name(name), data.generation, _actor(actor)))


@post(
    "/admin/models/{name:str}/versions/{version:str}/retire", status_code=202, security=ADMIN_SECURITY,
    tags=_TAGS, responses=error_responses(400, 401, 403, 404, 409),
)
async def retire_version(
    request: Request, name: FromPath[str], version: FromPath[str], admin: NamedDependency[None], actor: Actor = None,
) -> VersionOut:
    """409 while the alias points at the version. Otherwise it drains (state `draining`: no new
    request; the running ones finish), is unloaded on every replica, and becomes `retired`."""
    registry = _registry(request)
    record = await registry.service.retire(check_model_name(name), version, _actor(actor))
    return VersionOut.of(record, registry.hosted())


@get(
    "/admin/models/{name:str}/changes", security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403),
)
async def model_changes(request: Request, name: FromPath[str], admin: NamedDependency[None]) -> ChangesOut:
    """The change log, newest first (the last 200): what, when, by whom."""
    registry = _registry(request)
    return ChangesOut([ChangeOut.of(c) for c in await registry.service.changes(name)])


@get(
    "/admin/models/{name:str}/metrics", security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403, 404),
)
async def model_metrics(
    request: Request, name: FromPath[str], observability: NamedDependency[Observability],
    admin: NamedDependency[None],
) -> VersionMetricsOut:
    """Each version's requests, errors, TTFT, inter-token and end-to-end latency (p50 / p99) on this
    replica since it started, the canary beside the current version (docs/versions.md)."""
    registry = _registry(request)
    snapshot = await registry.sync.repo.snapshot()
    if check_model_name(name) not in snapshot.models:
        raise UnknownModelError(f"no model named {name!r} is registered")
    ids = sorted(version_id(v.model, v.version) for v in snapshot.versions.values() if v.model == name)
    return VersionMetricsOut(model=name, versions=version_figures(observability.metrics, ids))


@get(
    "/admin/tenants/{tenant_id:str}/models", security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403),
)
async def get_tenant_models(request: Request, tenant_id: FromPath[str], admin: NamedDependency[None]) -> TenantModels:
    """The tenant's model list; `models: null`: every model, as its alias says."""
    return TenantModels(models=await _registry(request).sync.repo.tenant_access(tenant_id))


@put(
    "/admin/tenants/{tenant_id:str}/models", security=ADMIN_SECURITY, tags=_TAGS,
    responses=error_responses(400, 401, 403, 404, 408, 413),
)
async def set_tenant_models(
    request: Request, tenant_id: FromPath[str], data: JSONBody[TenantModels], admin: NamedDependency[None],
    actor: Actor = None,
) -> TenantModels:
    """Limit the tenant to these models, each pinned to a version where one is given (for reproducible
    output); `{"models": null}` lifts the limit. Every replica applies it as it applies an alias."""
    registry = _registry(request)
    models = dict(data.models) if data.models is not None else None
    for name in models or {}:
        check_model_name(name)
    saved = await registry.sync.repo.set_tenant_access(tenant_id, models, _actor(actor))
    await registry.sync.notify()
    return TenantModels(models=saved)


VERSION_ROUTES = [
    list_registry, get_model, register_version, deploy_version, set_alias, rollback, retire_version, model_changes,
    model_metrics, get_tenant_models, set_tenant_models,
]
