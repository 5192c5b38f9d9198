"""Liveness, readiness, engine stats and Prometheus metrics.

/healthz (liveness) fails only when the process can no longer recover by itself: the driver gave
up (an engine in a crash loop), so an orchestrator should restart it. /readyz (readiness) says
whether a request can be served now: some engine is up (a degraded state, some engines restarting,
is 200 with `degraded` and the reason in the body)."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from drivers.base import Driver, DriverHealth
from gateway.metrics import GatewayMetrics


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


@get("/metrics")
async def metrics(metrics: NamedDependency[GatewayMetrics]) -> Response[bytes]:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


HEALTH_ROUTES = [healthz, readyz, engine_stats, metrics]
