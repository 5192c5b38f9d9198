"""Gateway settings: read once from the environment (and the CLI) at the edge, then passed down frozen.

What the engine is asked for lives in `engine` (`drivers.options.EngineOptions`); the driver turns
it into its own config, with the defaults of the engine layer for whatever is left unset."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from billing.config import BillingConfig
from drivers.options import EngineOptions, overrides
from drivers.supervisor import RestartPolicy
from gateway.cold_start import HoldPolicy
from scaling.desired import ScalingPolicy


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    """Interface to bind (SLUICE_HOST)."""
    port: int = 8000
    """TCP port to listen on (SLUICE_PORT)."""
    driver: str = "native"
    """Registered driver name serving requests: "native" or "synthetic" (SLUICE_DRIVER)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """The engine's knobs (model, queue bounds, batch sizes, engines, ...): SLUICE_MODEL,
    SLUICE_MAX_WAITING, SLUICE_MAX_WAITING_TOKENS and the `sluice serve` flags; unset ones keep the
    driver's defaults (see drivers/options.py)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted; bigger bodies get 413 (SLUICE_MAX_BODY_BYTES)."""
    body_timeout_s: float = 30.0
    """Longest a client may take to send a request's whole body; slower ones get 408 and the connection
    is closed (SLUICE_BODY_TIMEOUT_S)."""
    load_shedding: bool = True
    """Refuse early (503 + Retry-After) requests whose estimated queue wait exceeds their tier's TTFT
    target, or that would fill their tier's share of the queue (SLUICE_LOAD_SHEDDING=0 turns it off;
    the queue bounds still apply). See gateway/load_shedding.py."""
    ttft_targets_s: tuple[float, ...] = (2.0, 10.0, 30.0)
    """TTFT target of each priority tier, 0 first; tiers past the last use the last
    (SLUICE_TTFT_TARGETS_S, comma-separated seconds)."""
    queue_share: tuple[float, ...] = (1.0, 0.9, 0.75)
    """Fraction of the waiting queue's bounds each tier may fill, so lower tiers leave headroom to higher
    ones (SLUICE_QUEUE_SHARE, comma-separated)."""
    cold_start: HoldPolicy = field(default_factory=HoldPolicy)
    """Scale from zero: how many requests per tier wait for a first ready worker, and for how long
    (SLUICE_COLD_HOLD_MAX, SLUICE_COLD_HOLD_TIMEOUT_S). See gateway/cold_start.py."""
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    """Targets of the desired-workers signal (SLUICE_SCALING_HEADROOM, SLUICE_SCALING_KV_TARGET,
    SLUICE_SCALING_OCCUPANCY_TARGET, SLUICE_SCALING_PREFILL_TARGET, SLUICE_SCALING_MIN_WORKERS,
    SLUICE_SCALING_MAX_WORKERS, SLUICE_SCALING_MAX_STEP_UP); its TTFT
    targets are `ttft_targets_s`. See scaling/desired.py."""
    log_level: str = "INFO"
    """Root log level (SLUICE_LOG_LEVEL)."""
    max_default_tokens: int = 4096
    """Cap on max_tokens when a request omits it (remaining context otherwise) (SLUICE_MAX_DEFAULT_TOKENS)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long requests in flight may run on before they are ended (503 / an SSE error
    event) and the server exits; new requests are refused meanwhile (SLUICE_DRAIN_TIMEOUT_S). See
    gateway/drain.py."""
    stream_timeout_s: float = 600.0
    """Lifetime cap of one generation, streamed or not; longer ones are aborted (SLUICE_STREAM_TIMEOUT_S)."""
    keep_alive_timeout_s: float = 75.0
    """How long an idle client connection is kept open (SLUICE_KEEP_ALIVE_TIMEOUT_S). The server's clock
    starts when it has written a response, the client's when it has read it: with uvicorn's 5 s, which is
    also httpx's pool expiry, a client that read a stream ~5 s late (256 streams on one client) reused a
    connection the server was closing, and its next request died with a reset it never got an answer to.
    Longer than the clients' and load balancers' idle timeouts (httpx 5 s, aiohttp 15 s, AWS ALB 60 s),
    as nginx's 75 s is: the side that closes idle connections should be the client."""
    auth: bool = True
    """Tenants, API keys, limits and usage (SLUICE_AUTH=0 turns all of it off: a local dev server)."""
    data_dir: str = "data"
    """Where the embedded SQLite database lives when DATABASE_URL is unset (SLUICE_DATA_DIR)."""
    database_url: str | None = None
    """Tenant database, e.g. postgresql://host/db (DATABASE_URL); None: SQLite under data_dir."""
    redis_url: str | None = None
    """Shared rate-limit backend and replica coordination (REDIS_URL); None: in-process limits."""
    admin_key: str | None = None
    """Key for /admin endpoints (SLUICE_ADMIN_KEY); None: generated on first start, printed once,
    stored hashed. Never logged."""
    ratelimit_fail_mode: str = "open"
    """What to do when Redis is unreachable: "open" admits, "closed" refuses with 503
    (SLUICE_RATELIMIT_FAIL_MODE)."""
    ratelimit_timeout_s: float = 0.25
    """Longest a Redis rate-limit call may take before it counts as an outage and the fail mode
    decides (SLUICE_RATELIMIT_TIMEOUT_MS / 1000)."""
    auth_cache_ttl_s: float = 1.0
    """How long a key lookup is cached; bounds how late a revocation takes effect
    (SLUICE_AUTH_CACHE_TTL_S)."""
    usage_flush_interval_s: float = 0.25
    """Longest a usage record waits before its batch is written (SLUICE_USAGE_FLUSH_MS / 1000)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector base URL for traces and metrics (OTEL_EXPORTER_OTLP_ENDPOINT, e.g.
    http://127.0.0.1:4318); None: nothing is exported and no span is ever built."""
    service_name: str = "sluice"
    """OpenTelemetry service.name of this gateway (OTEL_SERVICE_NAME)."""
    metrics_tenant_cap: int = 100
    """Tenants that get their own label value on per-tenant counters; later ones are "other"
    (SLUICE_METRICS_TENANT_CAP)."""
    metrics_tenant_label: str = "id"
    """What the `tenant` label of per-tenant counters shows: "id", "name" (the name given in the admin
    API) or "none" (one series for all tenants) (SLUICE_METRICS_TENANT_LABEL)."""
    metrics_token: str | None = None
    """Bearer token that may read /metrics besides the admin key (SLUICE_METRICS_TOKEN). Unset: only the
    admin key, or, on a --no-auth server, anyone. Never logged."""
    telemetry: bool = True
    """Request metrics and traces (SLUICE_TELEMETRY=0 turns them off: the overhead benchmark's baseline).
    HTTP counters and per-node gauges stay."""
    registry_refresh_s: float = 5.0
    """How often each replica re-reads the model registry whatever Redis says; changes normally arrive
    through Redis within a second (SLUICE_REGISTRY_REFRESH_S; docs/versions.md)."""
    log_prompts: bool = False
    """Debug only: log request prompts (SLUICE_LOG_PROMPTS=1). Keys are never logged."""
    billing: BillingConfig = field(default_factory=BillingConfig)
    """Usage billing with Stripe meters: meters, window, Stripe key and address, the relay
    (SLUICE_BILLING_*, STRIPE_API_KEY; see billing/config.py). Off unless a meter is named."""
    fleet_workers: tuple[str, ...] = ()
    """Fleet driver: static worker base URLs (SLUICE_WORKERS, comma-separated; --workers)."""
    fleet_redis_url: str | None = None
    """Fleet driver and `sluice worker`: Redis of the fleet's membership (SLUICE_FLEET_REDIS_URL; --fleet-redis)."""
    fleet_policy: str = "prefix-affinity"
    """Fleet driver: round-robin, least-loaded or prefix-affinity (SLUICE_FLEET_POLICY; --fleet-policy)."""
    fleet_secret: str | None = None
    """Shared secret between gateways and workers (SLUICE_FLEET_SECRET); None: none. Never logged."""
    fleet_ca: str | None = None
    """CA bundle that signs the workers' TLS certificates (SLUICE_FLEET_CA); None: the system's."""
    sglang_servers: tuple[str, ...] = ()
    """SGLang driver: server base URLs (SLUICE_SGLANG_SERVERS, comma-separated; --sglang-servers)."""
    sglang_kv_events: tuple[str, ...] = ()
    """SGLang driver: the servers' KV event ZMQ endpoints, same order (SLUICE_SGLANG_KV_EVENTS)."""
    sglang_kv_replay: tuple[str, ...] = ()
    """SGLang driver: their replay endpoints, same order (SLUICE_SGLANG_KV_REPLAY)."""
    sglang_api_key: str | None = None
    """SGLang driver: the servers' --api-key (SLUICE_SGLANG_API_KEY); never logged."""
    sglang_chat_template: str | None = None
    """SGLang driver: Jinja chat template file; None: ChatML (SLUICE_SGLANG_CHAT_TEMPLATE)."""
    sglang_snapshot: str | None = None
    """SGLang driver: file of the approximate routing trees, saved and reloaded (SLUICE_SGLANG_SNAPSHOT)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `env` (default: os.environ); unset variables keep the defaults."""
        e = os.environ if env is None else env
        d = cls()
        return cls(
            host=e.get("SLUICE_HOST", d.host),
            port=int(e.get("SLUICE_PORT", d.port)),
            driver=e.get("SLUICE_DRIVER", d.driver),
            engine=EngineOptions(
                model=e.get("SLUICE_MODEL") or None,
                max_waiting=_int(e.get("SLUICE_MAX_WAITING")),
                max_waiting_tokens=_int(e.get("SLUICE_MAX_WAITING_TOKENS")),
                model_memory_budget_bytes=_bytes(e.get("SLUICE_MODEL_MEMORY_BUDGET")),
                restart=_restart_policy(e),
            ),
            max_body_bytes=int(e.get("SLUICE_MAX_BODY_BYTES", d.max_body_bytes)),
            body_timeout_s=float(e.get("SLUICE_BODY_TIMEOUT_S", d.body_timeout_s)),
            load_shedding=e.get("SLUICE_LOAD_SHEDDING", "1").lower() not in ("0", "false", "off", "no"),
            ttft_targets_s=_floats(e.get("SLUICE_TTFT_TARGETS_S"), d.ttft_targets_s),
            queue_share=_floats(e.get("SLUICE_QUEUE_SHARE"), d.queue_share),
            cold_start=HoldPolicy(
                max_held=tuple(int(v) for v in _floats(e.get("SLUICE_COLD_HOLD_MAX"), d.cold_start.max_held)),
                timeout_s=float(e.get("SLUICE_COLD_HOLD_TIMEOUT_S", d.cold_start.timeout_s)),
            ),
            scaling=ScalingPolicy(
                ttft_targets_s=_floats(e.get("SLUICE_TTFT_TARGETS_S"), d.ttft_targets_s),
                headroom=float(e.get("SLUICE_SCALING_HEADROOM", d.scaling.headroom)),
                kv_target=float(e.get("SLUICE_SCALING_KV_TARGET", d.scaling.kv_target)),
                occupancy_target=float(e.get("SLUICE_SCALING_OCCUPANCY_TARGET", d.scaling.occupancy_target)),
                prefill_target=float(e.get("SLUICE_SCALING_PREFILL_TARGET", d.scaling.prefill_target)),
                min_workers=int(e.get("SLUICE_SCALING_MIN_WORKERS", d.scaling.min_workers)),
                max_workers=int(e.get("SLUICE_SCALING_MAX_WORKERS", d.scaling.max_workers)),
                max_step_up=float(e.get("SLUICE_SCALING_MAX_STEP_UP", d.scaling.max_step_up)),
            ),
            log_level=e.get("SLUICE_LOG_LEVEL", d.log_level).upper(),
            max_default_tokens=int(e.get("SLUICE_MAX_DEFAULT_TOKENS", d.max_default_tokens)),
            stream_timeout_s=float(e.get("SLUICE_STREAM_TIMEOUT_S", d.stream_timeout_s)),
            keep_alive_timeout_s=float(e.get("SLUICE_KEEP_ALIVE_TIMEOUT_S", d.keep_alive_timeout_s)),
            drain_timeout_s=float(e.get("SLUICE_DRAIN_TIMEOUT_S", d.drain_timeout_s)),
            auth=e.get("SLUICE_AUTH", "1").lower() not in ("0", "false", "off", "no"),
            data_dir=e.get("SLUICE_DATA_DIR", d.data_dir),
            database_url=e.get("DATABASE_URL") or d.database_url,
            redis_url=e.get("REDIS_URL") or d.redis_url,
            admin_key=e.get("SLUICE_ADMIN_KEY") or d.admin_key,
            ratelimit_fail_mode=e.get("SLUICE_RATELIMIT_FAIL_MODE", d.ratelimit_fail_mode).lower(),
            ratelimit_timeout_s=float(e.get("SLUICE_RATELIMIT_TIMEOUT_MS", d.ratelimit_timeout_s * 1000))
            / 1000,
            auth_cache_ttl_s=float(e.get("SLUICE_AUTH_CACHE_TTL_S", d.auth_cache_ttl_s)),
            usage_flush_interval_s=float(e.get("SLUICE_USAGE_FLUSH_MS", d.usage_flush_interval_s * 1000))
            / 1000,
            otlp_endpoint=e.get("OTEL_EXPORTER_OTLP_ENDPOINT") or d.otlp_endpoint,
            service_name=e.get("OTEL_SERVICE_NAME") or d.service_name,
            metrics_tenant_cap=int(e.get("SLUICE_METRICS_TENANT_CAP", d.metrics_tenant_cap)),
            metrics_tenant_label=e.get("SLUICE_METRICS_TENANT_LABEL", d.metrics_tenant_label).lower(),
            metrics_token=e.get("SLUICE_METRICS_TOKEN") or d.metrics_token,
            telemetry=e.get("SLUICE_TELEMETRY", "1").lower() not in ("0", "false", "off", "no"),
            registry_refresh_s=float(e.get("SLUICE_REGISTRY_REFRESH_S", d.registry_refresh_s)),
            log_prompts=e.get("SLUICE_LOG_PROMPTS", "0").lower() in ("1", "true", "on", "yes"),
            billing=BillingConfig.from_env(e),
            fleet_workers=comma_list(e.get("SLUICE_WORKERS", "")),
            fleet_redis_url=e.get("SLUICE_FLEET_REDIS_URL") or d.fleet_redis_url,
            fleet_policy=e.get("SLUICE_FLEET_POLICY", d.fleet_policy),
            fleet_secret=e.get("SLUICE_FLEET_SECRET") or d.fleet_secret,
            fleet_ca=e.get("SLUICE_FLEET_CA") or d.fleet_ca,
            sglang_servers=comma_list(e.get("SLUICE_SGLANG_SERVERS", "")),
            sglang_kv_events=comma_list(e.get("SLUICE_SGLANG_KV_EVENTS", "")),
            sglang_kv_replay=comma_list(e.get("SLUICE_SGLANG_KV_REPLAY", "")),
            sglang_api_key=e.get("SLUICE_SGLANG_API_KEY") or d.sglang_api_key,
            sglang_chat_template=e.get("SLUICE_SGLANG_CHAT_TEMPLATE") or d.sglang_chat_template,
            sglang_snapshot=e.get("SLUICE_SGLANG_SNAPSHOT") or d.sglang_snapshot,
        )

    def __post_init__(self) -> None:
        if not self.ttft_targets_s or not self.queue_share:
            raise ValueError("SLUICE_TTFT_TARGETS_S and SLUICE_QUEUE_SHARE need at least one value")
        if self.ratelimit_fail_mode not in ("open", "closed"):
            raise ValueError(
                f"SLUICE_RATELIMIT_FAIL_MODE must be open or closed, not {self.ratelimit_fail_mode!r}"
            )
        if self.metrics_tenant_label not in ("id", "name", "none"):
            raise ValueError(
                f"SLUICE_METRICS_TENANT_LABEL must be id, name or none, not {self.metrics_tenant_label!r}"
            )

    def __repr__(self) -> str:  # keep secrets out of logs
        return (
            f"Settings(host={self.host!r}, port={self.port}, driver={self.driver!r}, model={self.engine.model!r})"
        )


def _restart_policy(env: Mapping[str, str]) -> RestartPolicy | None:
    """The engine restart policy's fields set in the environment; None when none is."""
    fields = overrides(
        backoff_initial_s=_float(env.get("SLUICE_ENGINE_RESTART_BACKOFF_S")),
        max_failures=_int(env.get("SLUICE_ENGINE_MAX_FAILURES")),
        failure_window_s=_float(env.get("SLUICE_ENGINE_FAILURE_WINDOW_S")),
    )
    return RestartPolicy(**fields) if fields else None


def _bytes(text: str | None) -> int | None:
    """A size such as 8GiB or 512MiB from the environment; unset or empty: None."""
    if not text or not text.strip():
        return None
    from gateway.cli import parse_bytes  # the one size syntax of flags and environment

    return parse_bytes(text)


def _float(text: str | None) -> float | None:
    return float(text) if text and text.strip() else None


def _int(text: str | None) -> int | None:
    """An integer from the environment; unset or empty: None (the default of the layer that owns it)."""
    return int(text) if text and text.strip() else None


def _floats(text: str | None, default: tuple[float, ...]) -> tuple[float, ...]:
    """'2,10,30' -> (2.0, 10.0, 30.0); unset or empty: the default."""
    if not text or not text.strip():
        return default
    return tuple(float(part) for part in text.split(","))


def comma_list(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): a list of URLs or endpoints from the environment or a flag."""
    return tuple(part.strip() for part in value.split(",") if part.strip())
