"""How long a gateway waits on a remote engine before it counts as lost: `sluice worker`s (the fleet
driver) and SGLang servers alike. A module of its own, without httpx, so that the configs that hold it stay
cheap to import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FleetTimeouts:
    connect_s: float = 1.0
    """Connection (and TLS handshake) to a worker (--fleet-connect-timeout)."""
    stall_s: float = 2.0
    """Silence (not even a keepalive) after which a worker counts as hung (--fleet-stall-timeout)."""
    first_token_s: float = 120.0
    """Longest wait for a request's first token on one worker (--fleet-first-token-timeout)."""
    inter_token_s: float = 30.0
    """Longest gap between two tokens on one worker (--fleet-inter-token-timeout)."""
