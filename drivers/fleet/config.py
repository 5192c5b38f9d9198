"""The fleet driver's configuration: where the workers are, how to pick one, when to give up on one."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivers.fleet.breaker import BreakerConfig
from drivers.fleet.router import RouterConfig
from drivers.fleet.timeouts import FleetTimeouts
from drivers.sglang.config import SGLangConfig
from observability.node_health import NodeHealthConfig


@dataclass(frozen=True)
class FleetConfig:
    workers: tuple[str, ...] = ()
    """Static worker base URLs (--workers); polled for their info. Empty: Redis membership only."""
    redis_url: str | None = None
    """Redis the workers register in (--fleet-redis, SLUICE_FLEET_REDIS_URL); None: static list only."""
    secret: str | None = None
    """Fleet secret sent as a bearer token to every worker (SLUICE_FLEET_SECRET)."""
    tls_verify: bool | str = True
    """Verify workers' TLS certificates (https:// addresses): True, False, or a CA bundle path
    (SLUICE_FLEET_CA)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    timeouts: FleetTimeouts = field(default_factory=FleetTimeouts)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    node_health: NodeHealthConfig = field(default_factory=NodeHealthConfig)
    max_attempts: int = 3
    """Workers one request may be tried on (the first included) before it fails (--fleet-max-attempts)."""
    rescan_s: float = 0.5
    """How often the membership view is rebuilt (Redis scan or static poll)."""
    ttl_s: float = 2.5
    """A static worker that has not answered its info poll for this long leaves the view (Redis:
    the record's TTL, set by the worker)."""
    sglang: SGLangConfig | None = None
    """SGLang servers as a second node kind of this fleet (--sglang-servers with --driver fleet;
    docs/sglang.md); None: `sluice worker`s only."""

    def __post_init__(self) -> None:
        if not self.workers and not self.redis_url and self.sglang is None:
            raise ValueError("the fleet driver needs --workers URL,..., --fleet-redis URL or --sglang-servers URL,...")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
