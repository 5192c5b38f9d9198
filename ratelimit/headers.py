"""OpenAI's `x-ratelimit-*` response headers, built the same way for every backend.

    x-ratelimit-limit-requests: 60        the per-minute limit
    x-ratelimit-remaining-requests: 59    whole units left in the bucket now
    x-ratelimit-reset-requests: 1s        time until the bucket is full again
    (and the same three for -tokens)

Reset times use OpenAI's (Go duration) format: "20ms", "1s", "1.5s", "6m0s", "1h0m0s".
An unlimited bucket sends no headers of its kind.
"""

from __future__ import annotations

import math

from ratelimit.base import TenantLimits


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI writes it; rounded up to the millisecond so it never understates."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(
    limits: TenantLimits,
    requests_remaining: float,
    requests_reset_s: float,
    tokens_remaining: float,
    tokens_reset_s: float,
) -> dict[str, str]:
    """The six headers (three per limited bucket); remaining levels are floored to whole units."""
    headers: dict[str, str] = {}
    for kind, limit, remaining, reset_s in (
        ("requests", limits.requests_per_minute, requests_remaining, requests_reset_s),
        ("tokens", limits.tokens_per_minute, tokens_remaining, tokens_reset_s),
    ):
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(remaining + 1e-9)))
        headers[f"x-ratelimit-reset-{kind}"] = format_reset(reset_s)
    return headers
