"""Billing views: the relay's state for the admin, billed usage for the admin and for a tenant itself."""

from __future__ import annotations

import datetime as dt

from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from billing.reports import billed_usage, relay_state
from gateway.auth import ADMIN_SECURITY, TENANT_SECURITY
from gateway.billing_schemas import BilledDayOut, BilledOut, RelayStateOut
from gateway.openapi import error_responses
from gateway.routes.admin import End, Start, _own_tenant
from gateway.settings import Settings
from gateway.tenancy import Tenancy
from tenants.auth import TenantContext
from tenants.service import report_window


async def _billed(request: Request, tenant_id: str, start: dt.datetime | None, end: dt.datetime | None) -> BilledOut:
    tenancy: Tenancy = request.app.state["tenancy"]
    await tenancy.tenants.get_tenant(tenant_id)  # 404 for an unknown tenant
    start, end = report_window(start, end)
    days = await billed_usage(tenancy.sessions, tenant_id, start, end)
    return BilledOut(tenant_id=tenant_id, start=start, end=end, data=[BilledDayOut.of(d) for d in days])


@get("/admin/billing", security=ADMIN_SECURITY, tags=["admin"], responses=error_responses(401, 403))
async def admin_billing(request: Request, admin: NamedDependency[None]) -> RelayStateOut:
    """Events pending, sent, dead-lettered; the lag; the newest dead-lettered events."""
    tenancy: Tenancy = request.app.state["tenancy"]
    settings: Settings = request.app.state["settings"]
    state = await relay_state(tenancy.sessions)
    return RelayStateOut.of(state, settings.billing.enabled, tenancy.relay is not None)


@get(
    "/admin/tenants/{tenant_id:str}/billing", security=ADMIN_SECURITY, tags=["admin"],
    responses=error_responses(400, 401, 403, 404),
)
async def tenant_billing(
    request: Request, tenant_id: FromPath[str], admin: NamedDependency[None], start: Start = None, end: End = None
) -> BilledOut:
    return await _billed(request, tenant_id, start, end)


@get("/v1/billing", security=TENANT_SECURITY, tags=["usage"], responses=error_responses(400, 401, 403, 429))
async def own_billing(
    request: Request, caller: NamedDependency[TenantContext | None], start: Start = None, end: End = None
) -> BilledOut:
    """The calling tenant's billed usage per day and meter: what Stripe counted, and what is on its way."""
    return await _billed(request, _own_tenant(request, caller), start, end)


BILLING_ROUTES = [admin_billing, tenant_billing, own_billing]
