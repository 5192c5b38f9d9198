"""Who is calling, as Litestar dependencies: `caller` for /v1 endpoints, `admin` for /admin.

Both read `Authorization: Bearer <key>`. With auth off (no tenancy) `caller`
is None and everything is allowed; the admin API is then not mounted at all.
Errors are the typed ones in `tenants.errors`, mapped to HTTP in `gateway.errors`.
"""

from __future__ import annotations

from litestar import Request
from litestar.openapi.spec import Components, SecurityScheme

from tenants.auth import TenantContext
from tenants.errors import AuthenticationError, PermissionDeniedError

SECURITY_COMPONENTS = Components(
    security_schemes={
        "ApiKey": SecurityScheme(
            type="http", scheme="bearer", description="A tenant key (sk-sluice-...) from the admin API"
        ),
        "AdminKey": SecurityScheme(
            type="http",
            scheme="bearer",
            description="The admin key (SLUICE_ADMIN_KEY or printed at first start)",
        ),
    }
)
TENANT_SECURITY: list[dict[str, list[str]]] = [{"ApiKey": []}]
ADMIN_SECURITY: list[dict[str, list[str]]] = [{"AdminKey": []}]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def provide_caller(request: Request) -> TenantContext | None:
    tenancy = request.app.state.get("tenancy")
    if tenancy is None:
        return None
    return await tenancy.keys.authenticate(bearer_token(request))


async def provide_admin(request: Request) -> None:
    """Passes for the admin key; a tenant key gets 403 (it is a real caller, just not allowed)."""
    tenancy = request.app.state["tenancy"]
    token = bearer_token(request)
    if tenancy.admin.is_admin(token):
        return
    if token is None:
        raise AuthenticationError("Missing admin key: send 'Authorization: Bearer <admin key>'")
    await tenancy.keys.authenticate(token)  # 401 for a key that is nobody's
    raise PermissionDeniedError("This endpoint needs the admin key")
