"""Liveness, readiness, engine stats and Prometheus metrics.

/healthz (liveness) fails only when the process can no longer recover by itself: the driver gave
up (an engine in a crash loop), so an orchestrator should restart it. /readyz (readiness) says
whether a request can be served now: some engine is up (a degraded state, some engines restarting,
is 200 with `degraded` and the reason in the body)."""

from __future__ import annotations

import hmac

import msgspec
from litestar import MediaType, Request, Response, get
from litestar.di import NamedDependency, Provide
from litestar.openapi.spec import Components, SecurityScheme
from prometheus_client import CONTENT_TYPE_LATEST

from drivers.base import Driver, DriverHealth
from gateway.auth import bearer_token
from gateway.metrics import GatewayMetrics
from gateway.openapi import error_responses
from gateway.scaling import ScalingMonitor
from gateway.settings import Settings
from tenants.errors import AuthenticationError


@get("/healthz")
async def healthz(driver: NamedDependency[Driver]) -> Response[dict[str, str]]:
    health = await driver.health()
    if health.live:
        return Response({"status": "ok"}, status_code=200)
    return Response({"status": "failed", "detail": health.detail}, status_code=503)


@get("/readyz")
async def readyz(request: Request, driver: NamedDependency[Driver]) -> Response[DriverHealth]:
    health = await driver.health()
    drain = request.app.state.get("drain")
    if drain is not None and drain.draining:  # shutting down (gateway/drain.py): take us out of rotation
        health = msgspec.structs.replace(health, ready=False, detail="draining: the server is shutting down")
    return Response(health, status_code=200 if health.ready else 503)


@get("/v1/engine/stats")
async def engine_stats(driver: NamedDependency[Driver]) -> DriverHealth:
    return await driver.health()


METRICS_SECURITY_COMPONENTS = Components(
    security_schemes={
        "MetricsToken": SecurityScheme(
            type="http", scheme="bearer", description="The metrics token (SLUICE_METRICS_TOKEN), for scrapers"
        )
    }
)


async def provide_metrics_reader(request: Request) -> None:
    """/metrics counts requests and tokens per tenant: the metrics token or the admin key may read it.

    A --no-auth server without a metrics token leaves it open: it has no tenants to tell apart (every
    request counts as tenant "none") and serves completions to anyone who can reach it anyway.
    """
    settings: Settings = request.app.state["settings"]
    token = bearer_token(request)
    expected = settings.metrics_token
    if token is not None and expected is not None and hmac.compare_digest(token.encode(), expected.encode()):
        return
    tenancy = request.app.state.get("tenancy")
    if tenancy is not None and tenancy.admin.is_admin(token):
        return
    if not settings.auth and settings.metrics_token is None:
        return
    raise AuthenticationError(
        "Reading /metrics needs 'Authorization: Bearer <metrics token (SLUICE_METRICS_TOKEN) or admin key>'"
    )


@get(
    "/metrics",
    media_type=MediaType.TEXT,
    security=[{"MetricsToken": []}, {"AdminKey": []}],
    dependencies={"metrics_reader": Provide(provide_metrics_reader)},
    responses=error_responses(401),
)
async def metrics(
    metrics: NamedDependency[GatewayMetrics], scaling: NamedDependency[ScalingMonitor],
    metrics_reader: NamedDependency[None],
) -> Response[bytes]:
    await scaling.refresh()  # the autoscaling gauges as of this scrape
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


HEALTH_ROUTES = [healthz, readyz, engine_stats, metrics]
