"""The app factory: wires a driver, settings, metrics and (auth on) the tenancy into a Litestar app."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import replace

from litestar import Litestar, Request
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.types import ControllerRouterHandler, Message, Scope

from drivers.base import Driver
from gateway.auth import SECURITY_COMPONENTS, provide_admin, provide_caller
from gateway.body_timeout import BodyReadDeadline
from gateway.drain import Drain
from gateway.errors import EXCEPTION_HANDLERS
from gateway.metrics import GatewayMetrics
from gateway.model_registry import ModelRegistry
from gateway.routes.admin import ADMIN_ROUTES
from gateway.routes.billing import BILLING_ROUTES
from gateway.routes.health import HEALTH_ROUTES, METRICS_SECURITY_COMPONENTS
from gateway.routes.nodes import NODE_DEPENDENCIES, NODE_ROUTES
from gateway.routes.openai import OPENAI_ROUTES
from gateway.routes.versions import VERSION_ROUTES
from gateway.scaling import ScalingCollector, ScalingMonitor
from gateway.service import CompletionService
from gateway.settings import Settings
from gateway.tenancy import FirstStartKeys, Tenancy
from observability.hub import Observability, ObservabilityConfig
from observability.metrics import TenantLabel
from tenants.auth import TenantContext
from web import console_router

log = logging.getLogger("sluice.gateway")


def create_app(settings: Settings, driver: Driver) -> Litestar:
    metrics = GatewayMetrics()
    service = CompletionService(driver, settings, metrics)
    # Request metrics always; traces and OTLP metrics only with an OTLP endpoint.
    observability = Observability(
        ObservabilityConfig(
            otlp_endpoint=settings.otlp_endpoint,
            service_name=settings.service_name,
            tenant_label_cap=settings.metrics_tenant_cap,
            tenant_label=TenantLabel(settings.metrics_tenant_label),
        ),
        metrics.registry,
        driver.nodes,
    )
    if settings.telemetry:
        service.observability = observability
    # Autoscaling signals (vllm:* names, sluice_desired_workers), refreshed when /metrics or /admin/nodes
    # is read; the formula's TTFT targets are the shedder's.
    scaling = ScalingMonitor(driver, service.shedder, service.cold_start,
                             replace(settings.scaling, ttft_targets_s=settings.ttft_targets_s))
    metrics.registry.register(ScalingCollector(scaling))
    drain = Drain(driver, settings.drain_timeout_s)  # SIGTERM: refuse new, finish or end the rest (drain.py)
    service.cold_start.stopping = lambda: drain.draining  # requests held for a worker end when it starts
    state = State({"settings": settings, "tenancy": None, "drain": drain, "registry": None})
    driver_started = asyncio.Event()  # the registry loads versions only beside a started driver

    @asynccontextmanager
    async def driver_lifespan(_: Litestar) -> AsyncGenerator[None, None]:
        # A model can take a while to load: the server listens meanwhile, /healthz answers and
        # /readyz says 503 until the driver is ready. A driver that starts at once is awaited.
        loading = asyncio.create_task(_start_driver(driver, drain, driver_started), name="sluice-driver-start")
        await asyncio.wait([loading], timeout=DRIVER_START_WAIT_S)
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loading
            await service.cold_start.close()
            await driver.stop()
            observability.shutdown()  # flushes spans still batched

    @asynccontextmanager
    async def tenancy_lifespan(_: Litestar) -> AsyncGenerator[None, None]:
        # Runs inside driver_lifespan, and after the drain (gateway/drain.py): every request has ended
        # and queued its usage record by then; stopping the tenancy flushes them, then the driver stops.
        tenancy, first_start = await Tenancy.start(settings, metrics.registry)
        if first_start is not None:
            _announce_first_start(first_start, settings)
        state["tenancy"] = tenancy
        service.gate = tenancy.gate
        # Names and aliases route from the start; versions load once the driver runs (docs/versions.md).
        registry = await ModelRegistry.start(settings, tenancy.sessions, driver, service.models, driver_started)
        state["registry"] = registry
        try:
            yield
        finally:
            state["registry"] = None
            await registry.stop()
            service.gate = None
            state["tenancy"] = None
            await tenancy.stop()

    async def provide_labelled_caller(request: Request) -> TenantContext | None:
        caller = await provide_caller(request)
        if caller is not None:  # metrics may label the tenant by name: learn it before its request counts
            observability.metrics.tenants.learn(caller.tenant_id, caller.tenant_name)
        return caller

    async def count_response(message: Message, scope: Scope) -> None:
        # before_send sees every response, including 404s for unknown routes and error responses.
        if message["type"] == "http.response.start":
            metrics.observe_response(scope["path"], message["status"])

    routes: list[ControllerRouterHandler] = [*OPENAI_ROUTES, *HEALTH_ROUTES, console_router()]
    if settings.auth:
        routes += ADMIN_ROUTES + BILLING_ROUTES + VERSION_ROUTES
    routes += NODE_ROUTES
    return Litestar(
        route_handlers=routes,
        dependencies={
            "service": Provide(lambda: service, use_cache=True, sync_to_thread=False),
            "driver": Provide(lambda: driver, use_cache=True, sync_to_thread=False),
            "metrics": Provide(lambda: metrics, use_cache=True, sync_to_thread=False),
            "scaling": Provide(lambda: scaling, use_cache=True, sync_to_thread=False),
            "observability": Provide(lambda: observability, use_cache=True, sync_to_thread=False),
            "caller": Provide(provide_labelled_caller),
            "admin": Provide(provide_admin),
            **NODE_DEPENDENCIES,
        },
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[driver_lifespan, *([tenancy_lifespan] if settings.auth else [])],
        # The drain sees every request first (503 once stopping); then the body-read deadline.
        middleware=[drain.middleware, BodyReadDeadline(settings.body_timeout_s)],
        before_send=[count_response],
        request_max_body_size=settings.max_body_bytes,
        state=state,
        openapi_config=OpenAPIConfig(
            title="Sluice",
            version="0.1.0",
            path="/schema",
            components=[SECURITY_COMPONENTS, METRICS_SECURITY_COMPONENTS],
        ),
        logging_config=None,  # the CLI configures logging; Litestar must not add its own handlers
    )


DRIVER_START_WAIT_S = 1.0  # start-up waits this long for the driver before listening without it


async def _start_driver(driver: Driver, drain: Drain, started: asyncio.Event) -> None:
    """Start the driver; if that fails the process cannot serve, so log why and shut down (status 1)."""
    try:
        await driver.start()
    except Exception as exc:
        log.exception("the driver failed to start; shutting down", extra={"error": str(exc)})
        drain.exit_code = 1
        os.kill(os.getpid(), signal.SIGTERM)
        return
    freeze_startup_heap()
    started.set()
    log.info("driver ready")


def freeze_startup_heap() -> None:
    """Collect once, then move what start-up made out of the collector's sight.

    The gateway holds ~300k objects once its driver is up (modules, the tokenizer, and ~95k numpy
    memmaps that reading the GGUF left as garbage), and a full collection walks them all: 120-240 ms
    on a 2-core EPYC, during which no stream of this process gets a byte. Such collections came
    every ~0.5 s after start and while the first requests ran (measured with gc.callbacks).
    Frozen objects are never collected, so this runs once the driver started, after a collection,
    as the engine process does once its model is loaded (engine_native/process.py)."""
    gc.collect()
    gc.freeze()


def _announce_first_start(keys: FirstStartKeys, settings: Settings) -> None:
    """Print the keys made on the first start once: they are stored hashed and cannot be shown again."""
    base = f"http://{settings.host}:{settings.port}"
    admin = keys.admin_key
    lines = [
        "",
        "Generated the admin key (shown once, stored hashed; set SLUICE_ADMIN_KEY to replace it):",
        f"  {admin}",
    ]
    if keys.tenant_key is not None:
        lines += [
            "Created tenant 'default' with an API key (shown once):",
            f"  {keys.tenant_key}",
            "Try it:",
            (
                f"  curl {base}/v1/chat/completions -H 'authorization: Bearer {keys.tenant_key}' "
                "-H 'content-type: application/json' "
                '-d \'{"messages": [{"role": "user", "content": "What is the capital of France?"}], '
                '"max_tokens": 32}\''
            ),
        ]
    lines += [
        "More tenants and keys:",
        (
            f"  curl -s {base}/admin/tenants -H 'authorization: Bearer {admin}' "
            "-H 'content-type: application/json' -d '{\"name\": \"me\"}'"
        ),
        (
            f"  curl -s {base}/admin/tenants/<tenant id>/keys -H 'authorization: Bearer {admin}' "
            "-H 'content-type: application/json' -d '{\"name\": \"laptop\"}'"
        ),
        f"Console: {base}/console/",
        "",
    ]
    print("\n".join(lines), flush=True)
