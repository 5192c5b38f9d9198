"""Gateway settings: read once from the environment at the edge, then passed down frozen."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    """Interface to bind (SLUICE_HOST)."""
    port: int = 8000
    """TCP port to listen on (SLUICE_PORT)."""
    driver: str = "native"
    """Registered driver name serving requests: "native" or "synthetic" (SLUICE_DRIVER)."""
    model: str | None = None
    """Model path for the native driver; None lets the driver pick its bundled model (SLUICE_MODEL)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted; bigger bodies get 413 (SLUICE_MAX_BODY_BYTES)."""
    max_waiting: int = 256
    """Requests the driver may queue beyond those running before it sheds load with 503 (SLUICE_MAX_WAITING)."""
    log_level: str = "INFO"
    """Root log level (SLUICE_LOG_LEVEL)."""
    max_default_tokens: int = 4096
    """Cap on max_tokens when a request omits it (remaining context otherwise) (SLUICE_MAX_DEFAULT_TOKENS)."""
    stream_timeout_s: float = 600.0
    """Lifetime cap of one generation, streamed or not; longer ones are aborted (SLUICE_STREAM_TIMEOUT_S)."""
    database_url: str | None = None
    """Tenant database (DATABASE_URL); unused by the gateway so far."""
    redis_url: str | None = None
    """Rate-limit backend (REDIS_URL); unused by the gateway so far."""
    admin_key: str | None = None
    """Key for admin endpoints (SLUICE_ADMIN_KEY); unused so far and never logged."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `env` (default: os.environ); unset variables keep the defaults."""
        e = os.environ if env is None else env
        d = cls()
        return cls(
            host=e.get("SLUICE_HOST", d.host),
            port=int(e.get("SLUICE_PORT", d.port)),
            driver=e.get("SLUICE_DRIVER", d.driver),
            model=e.get("SLUICE_MODEL") or d.model,
            max_body_bytes=int(e.get("SLUICE_MAX_BODY_BYTES", d.max_body_bytes)),
            max_waiting=int(e.get("SLUICE_MAX_WAITING", d.max_waiting)),
            log_level=e.get("SLUICE_LOG_LEVEL", d.log_level).upper(),
            max_default_tokens=int(e.get("SLUICE_MAX_DEFAULT_TOKENS", d.max_default_tokens)),
            stream_timeout_s=float(e.get("SLUICE_STREAM_TIMEOUT_S", d.stream_timeout_s)),
            database_url=e.get("DATABASE_URL") or d.database_url,
            redis_url=e.get("REDIS_URL") or d.redis_url,
            admin_key=e.get("SLUICE_ADMIN_KEY") or d.admin_key,
        )

    def __repr__(self) -> str:  # keep secrets out of logs
        return f"Settings(host={self.host!r}, port={self.port}, driver={self.driver!r}, model={self.model!r})"
