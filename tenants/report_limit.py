"""How often one caller may ask for usage reports: an in-process token bucket per API key.

A usage or latency report costs the database a scan of up to a month of records, so a key
gets `per_minute` of them, in bursts of up to that many, refilled evenly over the minute.
Per replica: N replicas allow N times the rate, which is fine for a guard against loops
and scripts (the per-request limits in `ratelimit/` are the shared, exact ones).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ratelimit.buckets import TokenBucket
from tenants.errors import RateLimitedError


@dataclass(frozen=True)
class ReportLimitConfig:
    per_minute: int = 60
    """Reports one key may fetch per minute (/v1/usage and /v1/usage/latency together)."""
    max_callers: int = 10_000
    """Buckets kept; the least recently used is forgotten first (a forgotten bucket is a full one)."""


class ReportLimiter:
    def __init__(
        self, config: ReportLimitConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or ReportLimitConfig()
        self.clock = clock
        self._bucket = TokenBucket(self.config.per_minute)
        self._levels: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (level, at)

    def check(self, caller: str) -> None:
        """Take one report from `caller`'s bucket, or raise RateLimitedError (429 with Retry-After)."""
        now = self.clock()
        level, at = self._levels.pop(caller, (None, now))
        level = self._bucket.level_at(level, at, now)
        if level < 1.0:
            self._levels[caller] = (level, now)
            wait_s = self._bucket.wait_s(level, 1.0)
            retry = str(max(1, math.ceil(wait_s)))
            raise RateLimitedError(
                f"Too many usage reports: at most {self.config.per_minute} per minute per key",
                wait_s,
                {"retry-after": retry},
            )
        self._levels[caller] = (level - 1.0, now)
        while len(self._levels) > self.config.max_callers:
            self._levels.popitem(last=False)
