"""The token-bucket math and the admission verdict: the one definition every backend follows.

The in-process backend calls these functions directly; the Redis backend's Lua
script (`ratelimit/lua.py`) is a line-by-line mirror of them, and the tests run
the same scenarios against both to keep them honest.

A bucket is (level, updated_at). It holds at most `capacity` = the per-minute
limit and refills continuously at `capacity / 60` per second:

    level
    capacity ┤        ╭──────────  full: equivalent to "no state stored"
             │      ╱
             │    ╱   slope = capacity / 60 s
       level ┤──●     (admission charged here)
             └──┴────────────────▶ time
             updated_at

No state means a full bucket, so a backend may forget a bucket once it has
had time to refill (`reset_s`), which is what keeps idle tenants free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratelimit.base import TenantLimits

SECONDS_PER_WINDOW = 60.0
# A concurrency refusal has no refill curve to read a wait from; streams last
# seconds, so ask the client to come back in about one.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True)
class TokenBucket:
    """A per-minute limit seen as a bucket: `capacity` units refilling at `capacity / 60` per second."""

    capacity: int

    @property
    def refill_per_s(self) -> float:
        return self.capacity / SECONDS_PER_WINDOW

    def level_at(self, level: float | None, updated_at_s: float, now_s: float) -> float:
        """The level at `now_s`, refilled since `updated_at_s`; None (no state) is a full bucket."""
        if level is None:
            return float(self.capacity)
        # Clocks that step backwards must never drain a bucket.
        elapsed = max(0.0, now_s - updated_at_s)
        return min(float(self.capacity), level + elapsed * self.refill_per_s)

    def wait_s(self, level: float, amount: float) -> float:
        """Seconds until `level` has refilled to `amount`; inf when `amount` can never fit."""
        if level >= amount:
            return 0.0
        if amount > self.capacity or self.refill_per_s <= 0:
            return math.inf
        return (amount - level) / self.refill_per_s

    def reset_s(self, level: float) -> float:
        """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`)."""
        if self.refill_per_s <= 0:
            return 0.0
        return max(0.0, (self.capacity - level) / self.refill_per_s)

    def refund(self, level: float, amount: float) -> float:
        """Give `amount` back, never above capacity."""
        return min(float(self.capacity), level + max(0.0, amount))


@dataclass(frozen=True)
class Verdict:
    """What `decide()` says about one admission, given refilled levels and the in-flight count."""

    allowed: bool
    refused_by: str | None = None
    retry_after_s: float = 0.0
    # Set when the request can never pass as it is (it asks more than a bucket holds).
    message: str | None = None


def never_admissible(limits: TenantLimits, tokens: int, sequences: int = 1) -> Verdict | None:
    """A refusal (retry_after_s 0, with a message) if the request could not pass even on full buckets
    and no other request in flight."""
    rpm, tpm, cap = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    if rpm is not None and rpm < 1:
        return Verdict(False, "requests", 0.0, "requests_per_minute is 0: this tenant may not send requests")
    if tpm is not None and tokens > tpm:
        return Verdict(
            False,
            "tokens",
            0.0,
            f"request reserves {tokens} tokens (prompt + max_tokens) but the limit is {tpm} tokens per "
            "minute: it can never be admitted; lower max_tokens or shorten the prompt",
        )
    if cap is not None and cap < 1:
        return Verdict(False, "concurrency", 0.0, "max_concurrent is 0: this tenant may not send requests")
    if cap is not None and sequences > cap:
        return Verdict(
            False,
            "concurrency",
            0.0,
            f"request runs {sequences} sequences (prompts x n) but the limit is {cap} concurrent "
            "sequences: it can never be admitted; lower n or send fewer prompts per request",
        )
    return None


def decide(
    limits: TenantLimits,
    requests_level: float,
    tokens_level: float,
    in_flight: int,
    tokens: int,
    sequences: int = 1,
) -> Verdict:
    """Admit only if every limit has room: 1 request, `tokens` tokens and `sequences` concurrency slots.

    `requests_level` / `tokens_level` are already refilled to now (ignored for an
    unlimited bucket); `in_flight` is the sequences of the live leases. A refusal
    names the first short limit in the order requests, tokens, concurrency, and its
    retry-after is the longest wait among all short limits, so a retry at that time
    is not refused by another one.
    """
    never = never_admissible(limits, tokens, sequences)
    if never is not None:
        return never
    rpm, tpm, cap = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    short: list[tuple[str, float]] = []
    if rpm is not None and requests_level < 1:
        short.append(("requests", TokenBucket(rpm).wait_s(requests_level, 1)))
    if tpm is not None and tokens_level < tokens:
        short.append(("tokens", TokenBucket(tpm).wait_s(tokens_level, tokens)))
    if cap is not None and in_flight + sequences > cap:
        short.append(("concurrency", CONCURRENCY_RETRY_S))
    if not short:
        return Verdict(True)
    return Verdict(False, short[0][0], max(wait for _, wait in short))
