"""The admin API (tenants, keys, usage, models) and a tenant's own usage at /v1/usage.

Handlers translate between the wire schemas and `tenants.service`; the admin
guard is the `admin` dependency, the tenant one `caller` (see gateway.auth).
A key may fetch /v1/usage reports only so often (`tenants.report_limit`): 429
with Retry-After beyond that.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from litestar import Request, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody, QueryParameter

from drivers.base import Driver
from gateway.admin_schemas import (
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyOut,
    LatencyOut,
    TenantCreate,
    TenantList,
    TenantOut,
    TenantUpdate,
    UsageOut,
)
from gateway.auth import ADMIN_SECURITY, TENANT_SECURITY
from gateway.openapi import error_responses
from gateway.schemas import ModelList, ModelObject
from gateway.service import CompletionService
from gateway.tenancy import Tenancy
from tenants.auth import TenantContext
from tenants.errors import AuthenticationError
from tenants.service import TenantService, TenantSpec

GroupBy = Literal["day", "model"]
Start = Annotated[
    dt.datetime | None, QueryParameter(description="inclusive, ISO 8601; default: month start (UTC)")
]
End = Annotated[dt.datetime | None, QueryParameter(description="exclusive, ISO 8601; default: now")]


def _tenancy(request: Request) -> Tenancy:
    tenancy: Tenancy = request.app.state["tenancy"]
    return tenancy


def _tenants(request: Request) -> TenantService:
    return _tenancy(request).tenants


@post(
    "/admin/tenants", status_code=201, security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 408, 409, 413),
)
async def create_tenant(
    request: Request, data: JSONBody[TenantCreate], admin: NamedDependency[None]
) -> TenantOut:
    spec = TenantSpec(
        name=data.name,
        priority=data.priority,
        requests_per_minute=data.requests_per_minute,
        tokens_per_minute=data.tokens_per_minute,
        max_concurrent=data.max_concurrent,
        monthly_token_budget=data.monthly_token_budget,
        weight=data.weight,
        stripe_customer_id=data.stripe_customer_id,
    )
    return TenantOut.of(await _tenants(request).create_tenant(spec))


@get("/admin/tenants", security=ADMIN_SECURITY, tags=["admin"], responses=error_responses(401, 403))
async def list_tenants(request: Request, admin: NamedDependency[None]) -> TenantList:
    return TenantList([TenantOut.of(t) for t in await _tenants(request).list_tenants()])


@get(
    "/admin/tenants/{tenant_id:str}", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def get_tenant(request: Request, tenant_id: FromPath[str], admin: NamedDependency[None]) -> TenantOut:
    return TenantOut.of(await _tenants(request).get_tenant(tenant_id))


@patch(
    "/admin/tenants/{tenant_id:str}", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404, 408, 409, 413),
)
async def update_tenant(
    request: Request, tenant_id: FromPath[str], data: JSONBody[TenantUpdate], admin: NamedDependency[None]
) -> TenantOut:
    """Change limits, tier or name; `{"status": "suspended"}` suspends, `"active"` reactivates."""
    tenant = await _tenants(request).update_tenant(tenant_id, data.changes())
    _tenancy(request).keys.forget()  # the cache is by key, not tenant; it refills in one read per key
    return TenantOut.of(tenant)


@delete(
    "/admin/tenants/{tenant_id:str}", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def delete_tenant(request: Request, tenant_id: FromPath[str], admin: NamedDependency[None]) -> None:
    """Deletes the tenant and its keys; its usage records stay (billing history)."""
    await _tenants(request).delete_tenant(tenant_id)
    _tenancy(request).keys.forget()


@post(
    "/admin/tenants/{tenant_id:str}/keys", status_code=201, security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404, 408, 413),
)
async def create_key(
    request: Request, tenant_id: FromPath[str], data: JSONBody[KeyCreate], admin: NamedDependency[None]
) -> KeyCreated:
    """The reply's `key` is the secret; it is shown this once and stored only as a hash."""
    key, secret = await _tenants(request).create_key(tenant_id, data.name, data.expires_at)
    out = KeyOut.of(key)
    return KeyCreated(**{f: getattr(out, f) for f in out.__struct_fields__}, key=secret)


@get(
    "/admin/tenants/{tenant_id:str}/keys", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def list_keys(request: Request, tenant_id: FromPath[str], admin: NamedDependency[None]) -> KeyList:
    return KeyList([KeyOut.of(k) for k in await _tenants(request).list_keys(tenant_id)])


@delete(
    "/admin/keys/{key_id:str}", status_code=200, security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def revoke_key(request: Request, key_id: FromPath[str], admin: NamedDependency[None]) -> KeyOut:
    """Revokes at once in the database; this replica refuses the key from its next request, every
    other replica within the auth cache TTL (1 s)."""
    key = await _tenants(request).revoke_key(key_id)
    _tenancy(request).keys.forget(key.key_hash)
    return KeyOut.of(key)


@get(
    "/admin/tenants/{tenant_id:str}/usage", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def tenant_usage(
    request: Request,
    tenant_id: FromPath[str],
    admin: NamedDependency[None],
    start: Start = None,
    end: End = None,
    group_by: Annotated[GroupBy, QueryParameter()] = "day",
) -> UsageOut:
    return UsageOut.of(await _tenants(request).usage(tenant_id, start, end, group_by))


def _own_tenant(request: Request, caller: TenantContext | None) -> str:
    """The tenant of the calling key: usage endpoints under /v1 only ever show the caller's own,
    and only `ReportLimitConfig.per_minute` times a minute per key (429 beyond)."""
    if caller is None:
        raise AuthenticationError("Usage needs an API key")
    tenancy: Tenancy = request.app.state["tenancy"]
    tenancy.reports.check(caller.key_id)
    return caller.tenant_id


@get("/v1/usage", security=TENANT_SECURITY, tags=["usage"], responses=error_responses(400, 401, 403, 429))
async def own_usage(
    request: Request,
    caller: NamedDependency[TenantContext | None],
    start: Start = None,
    end: End = None,
    group_by: Annotated[GroupBy, QueryParameter()] = "day",
) -> UsageOut:
    """The calling tenant's usage; a key can only ever see its own tenant's."""
    return UsageOut.of(await _tenants(request).usage(_own_tenant(request, caller), start, end, group_by))


@get(
    "/admin/tenants/{tenant_id:str}/latency", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def tenant_latency(
    request: Request,
    tenant_id: FromPath[str],
    admin: NamedDependency[None],
    start: Start = None,
    end: End = None,
    group_by: Annotated[GroupBy, QueryParameter()] = "day",
) -> LatencyOut:
    return LatencyOut.of(await _tenants(request).latency(tenant_id, start, end, group_by))


@get(
    "/v1/usage/latency", security=TENANT_SECURITY, tags=["usage"], responses=error_responses(400, 401, 403, 429)
)
async def own_latency(
    request: Request,
    caller: NamedDependency[TenantContext | None],
    start: Start = None,
    end: End = None,
    group_by: Annotated[GroupBy, QueryParameter()] = "day",
) -> LatencyOut:
    """p50/p90/p99 of the calling tenant's time to first token and end-to-end latency."""
    return LatencyOut.of(await _tenants(request).latency(_own_tenant(request, caller), start, end, group_by))


@get("/admin/models", security=ADMIN_SECURITY, tags=["admin"], responses=error_responses(401, 403))
async def admin_models(
    driver: NamedDependency[Driver], service: NamedDependency[CompletionService], admin: NamedDependency[None]
) -> ModelList:
    """What /v1/models lists, for the admin key (which is no tenant's and so cannot call /v1)."""
    cards = service.models.public_cards(driver.models())
    return ModelList(data=[ModelObject(c.id, c.created, c.owned_by, c.max_model_len) for c in cards])


ADMIN_ROUTES = [
    create_tenant,
    list_tenants,
    get_tenant,
    update_tenant,
    delete_tenant,
    create_key,
    list_keys,
    revoke_key,
    tenant_usage,
    own_usage,
    tenant_latency,
    own_latency,
    admin_models,
]
