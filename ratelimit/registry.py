"""Chooses the rate-limit backend: Redis when a URL is configured, in-process otherwise."""

from __future__ import annotations

from typing import Any

from ratelimit.base import FailMode, RateLimiter
from ratelimit.headers import format_reset, ratelimit_headers
from ratelimit.memory import InProcessRateLimiter
from ratelimit.redis_backend import RedisRateLimiter

__all__ = ["create_rate_limiter", "format_reset", "ratelimit_headers"]

# Options only a shared backend has meaning for; the in-process one accepts and ignores them,
# so the gateway can pass one set of settings whichever backend is chosen.
_REDIS_ONLY = {"key_prefix", "timeout_s", "registry", "retry"}


def create_rate_limiter(
    redis_url: str | None, fail_mode: FailMode = FailMode.OPEN, **opts: Any
) -> RateLimiter:
    """A `RedisRateLimiter(redis_url, fail_mode, **opts)`, or an `InProcessRateLimiter` when no URL.

    opts: `lease_s` (both), `key_prefix`, `timeout_s`, `registry`, `retry` (Redis only; ignored
    in-process).
    Unknown options raise TypeError, so a typo in settings fails at startup.
    """
    if redis_url:
        return RedisRateLimiter(redis_url, fail_mode, **opts)
    unknown = set(opts) - _REDIS_ONLY - {"lease_s"}
    if unknown:
        raise TypeError(f"unknown rate limiter options: {sorted(unknown)}")
    return InProcessRateLimiter(**{k: v for k, v in opts.items() if k == "lease_s"})
