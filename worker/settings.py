"""The worker's configuration: read once from flags and environment at the edge (worker/cli.py)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from drivers.options import EngineOptions


@dataclass(frozen=True)
class WorkerSettings:
    host: str = "127.0.0.1"
    """Interface to bind (--host)."""
    port: int = 8100
    """TCP port (--port)."""
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-worker")
    """Stable name of this worker in the fleet (--worker-id, SLUICE_WORKER_ID); a restart keeps it and
    gets a higher incarnation."""
    advertise_url: str | None = None
    """Base URL gateways reach it at (--advertise-url); None: http://host:port."""
    driver: str = "native"
    """The engine it hosts: "native" or "synthetic" (--driver)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """The hosted driver's knobs (the same flags as `sluice serve`)."""
    fleet_secret: str | None = None
    """Shared secret every gateway request must carry as a bearer token (SLUICE_FLEET_SECRET);
    None: no authentication (a trusted network only)."""
    redis_url: str | None = None
    """Where to register and heartbeat (--redis, REDIS_URL); None: static `--workers` lists only."""
    heartbeat_interval_s: float = 0.5
    """How often the Redis record (state, load) is refreshed."""
    heartbeat_ttl_s: float = 2.5
    """The record's TTL: a worker that misses heartbeats this long is out of every gateway's view."""
    keepalive_s: float = 0.5
    """A generate stream with no token for this long gets a keepalive line, so silence means hung."""
    stream_interval_s: float = 0.0
    """Least time between two token frames of one stream (--stream-interval-ms); tokens that come
    meanwhile ride in the next frame. 0: a frame whenever the stream is written, holding every token
    ready by then (worker/stream.py)."""
    drain_timeout_s: float = 60.0
    """On SIGTERM, how long requests in flight may finish before they are ended and the worker exits."""
    keep_alive_timeout_s: float = 75.0
    """How long an idle gateway connection is kept open: longer than the gateways' pool expiry (httpx's
    5 s), so the gateway closes idle connections, never the worker under a request (gateway/settings.py
    says why)."""
    max_body_bytes: int = 8 << 20
    """Largest request body (a tokenized prompt); larger gets 413."""
    log_level: str = "INFO"
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector for the worker's spans (OTEL_EXPORTER_OTLP_ENDPOINT); each generate is a
    span whose parent is the gateway's `traceparent` header. None: no tracing."""
    service_name: str = "sluice-worker"
    """OpenTelemetry service.name of the worker's spans (OTEL_SERVICE_NAME)."""
    ssl_keyfile: str | None = None
    """TLS key and certificate (uvicorn's --ssl-* options): the worker serves https."""
    ssl_certfile: str | None = None

    @property
    def address(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"
