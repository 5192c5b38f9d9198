"""The app factory: wires a driver, settings and metrics into a Litestar app."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.types import Message, Scope

from drivers.base import Driver
from gateway.errors import EXCEPTION_HANDLERS
from gateway.metrics import GatewayMetrics
from gateway.routes.health import HEALTH_ROUTES
from gateway.routes.openai import OPENAI_ROUTES
from gateway.service import CompletionService
from gateway.settings import Settings


def create_app(settings: Settings, driver: Driver) -> Litestar:
    metrics = GatewayMetrics()
    service = CompletionService(driver, settings, metrics)

    @asynccontextmanager
    async def driver_lifespan(_: Litestar) -> AsyncGenerator[None, None]:
        await driver.start()
        try:
            yield
        finally:
            await driver.stop()

    async def count_response(message: Message, scope: Scope) -> None:
        # before_send sees every response, including 404s for unknown routes and error responses.
        if message["type"] == "http.response.start":
            metrics.observe_response(scope["path"], message["status"])

    return Litestar(
        route_handlers=[*OPENAI_ROUTES, *HEALTH_ROUTES],
        dependencies={
            "service": Provide(lambda: service, use_cache=True, sync_to_thread=False),
            "driver": Provide(lambda: driver, use_cache=True, sync_to_thread=False),
            "metrics": Provide(lambda: metrics, use_cache=True, sync_to_thread=False),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[driver_lifespan],
        before_send=[count_response],
        request_max_body_size=settings.max_body_bytes,
        state=State({"settings": settings}),
        openapi_config=None,
        logging_config=None,  # the CLI configures logging; Litestar must not add its own handlers
    )
