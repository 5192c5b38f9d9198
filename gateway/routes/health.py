"""Liveness, readiness, engine stats and Prometheus metrics."""

from __future__ import annotations

from litestar import Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from drivers.base import Driver, DriverHealth
from gateway.metrics import GatewayMetrics


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}  # the process answers: alive, whatever the engine's state


@get("/readyz")
async def readyz(driver: NamedDependency[Driver]) -> Response[DriverHealth]:
    health = await driver.health()
    return Response(health, status_code=200 if health.ready else 503)


@get("/v1/engine/stats")
async def engine_stats(driver: NamedDependency[Driver]) -> DriverHealth:
    return await driver.health()


@get("/metrics")
async def metrics(metrics: NamedDependency[GatewayMetrics]) -> Response[bytes]:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


HEALTH_ROUTES = [healthz, readyz, engine_stats, metrics]
