"""The SGLang driver's configuration: which servers, how to route among them, when to give up on one."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivers.fleet.breaker import BreakerConfig
from drivers.fleet.timeouts import FleetTimeouts
from observability.node_health import NodeHealthConfig


@dataclass(frozen=True)
class CacheRoutingConfig:
    page_size: int = 16
    """Tokens per page of the approximate prefix tree (the gateway's own, not SGLang's page size)."""
    max_pages_per_server: int = 65_536
    """Pages the approximate tree keeps per server before it forgets the least recently routed."""
    min_match_tokens: int = 32
    """A cached prefix shorter than this is not worth a detour: such a request goes least-loaded."""
    balance_abs: int = 4
    """Load-imbalance guard: when the busiest and idlest candidates differ by more than this many
    requests AND by more than `balance_rel` times, the request goes to the least-loaded server
    whatever the cache says (SGLang's router: balance_abs_threshold)."""
    balance_rel: float = 1.5
    """See `balance_abs` (SGLang's router: balance_rel_threshold)."""


@dataclass(frozen=True)
class SGLangConfig:
    servers: tuple[str, ...] = ()
    """SGLang server base URLs, e.g. http://10.0.0.5:30000 (--sglang-servers, SLUICE_SGLANG_SERVERS)."""
    kv_events: tuple[str, ...] = ()
    """ZMQ endpoints of the servers' KV event publishers, one per server in the same order, e.g.
    tcp://10.0.0.5:5557 (--sglang-kv-events, SLUICE_SGLANG_KV_EVENTS); empty: approximate routing."""
    kv_replay: tuple[str, ...] = ()
    """Their replay endpoints (`replay_endpoint` of --kv-events-config), same order; a fresh gateway
    asks them for the buffered events so it does not start cache-blind (--sglang-kv-replay)."""
    api_key: str | None = None
    """The servers' --api-key, sent as a bearer token (SLUICE_SGLANG_API_KEY); never logged."""
    chat_template: str | None = None
    """Jinja chat template file to render chat messages with (SGLang's /tokenize takes text only);
    None: ChatML (SLUICE_SGLANG_CHAT_TEMPLATE)."""
    snapshot_path: str | None = None
    """File the approximate trees are saved to (every `snapshot_s` and at stop) and loaded from at
    start, so a restarted gateway is not cache-blind without KV events (--sglang-snapshot,
    SLUICE_SGLANG_SNAPSHOT); None: none."""
    snapshot_s: float = 30.0
    """How often the snapshot is written."""
    routing: CacheRoutingConfig = field(default_factory=CacheRoutingConfig)
    timeouts: FleetTimeouts = field(default_factory=FleetTimeouts)
    """connect_s, first_token_s and inter_token_s apply; stall_s does not (SGLang sends no keepalives
    while a request waits, so silence before the first token is normal)."""
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    node_health: NodeHealthConfig = field(default_factory=NodeHealthConfig)
    max_attempts: int = 3
    """Servers one request may be tried on (the first included) before it fails."""
    poll_s: float = 1.0
    """How often each server's /health_generate and /get_load are polled."""
    down_after_s: float = 5.0
    """A server whose polls have failed for this long is out of the routing view."""

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("the sglang driver needs --sglang-servers URL,...")
        if self.kv_events and len(self.kv_events) != len(self.servers):
            raise ValueError("--sglang-kv-events needs one endpoint per server, in the same order")
        if self.kv_replay and len(self.kv_replay) != len(self.kv_events):
            raise ValueError("--sglang-kv-replay needs one endpoint per --sglang-kv-events endpoint")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
