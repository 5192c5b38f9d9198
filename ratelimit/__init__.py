"""Tenant admission control: per-tenant token buckets and concurrency caps (see `ratelimit.base`)."""

from ratelimit.base import Admission, FailMode, RateLimiter, Reservation, TenantLimits
from ratelimit.registry import create_rate_limiter, ratelimit_headers

__all__ = [
    "Admission",
    "FailMode",
    "RateLimiter",
    "Reservation",
    "TenantLimits",
    "create_rate_limiter",
    "ratelimit_headers",
]
