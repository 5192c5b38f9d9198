"""The pure bucket math, the verdict and OpenAI's reset format."""

from __future__ import annotations

import math

import pytest

from ratelimit.base import TenantLimits
from ratelimit.buckets import CONCURRENCY_RETRY_S, TokenBucket, decide
from ratelimit.headers import format_reset, ratelimit_headers


def test_bucket_refills_continuously_up_to_capacity() -> None:
    bucket = TokenBucket(600)  # 10/s
    assert bucket.refill_per_s == 10
    assert bucket.level_at(None, 0, 5) == 600  # no state: full
    assert bucket.level_at(100, 10, 12.5) == pytest.approx(125)
    assert bucket.level_at(590, 0, 100) == 600
    assert bucket.level_at(100, 10, 9) == 100  # a clock going back never drains


def test_bucket_waits_resets_and_refunds() -> None:
    bucket = TokenBucket(1500)
    assert bucket.wait_s(500, 1000) == pytest.approx(20)
    assert bucket.wait_s(1000, 1000) == 0
    assert bucket.wait_s(1500, 1501) == math.inf
    assert bucket.reset_s(500) == pytest.approx(40)
    assert bucket.refund(1400, 900) == 1500
    assert bucket.refund(100, -50) == 100


def test_decide_names_first_short_limit_and_longest_wait() -> None:
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=600, max_concurrent=2)
    assert decide(limits, 1, 600, 1, 600).allowed
    both = decide(limits, 0.5, 500, 2, 600)
    assert both.refused_by == "requests" and both.retry_after_s == pytest.approx(10)
    conc = decide(limits, 5, 600, 2, 10)
    assert conc.refused_by == "concurrency" and conc.retry_after_s == CONCURRENCY_RETRY_S
    never = decide(limits, 60, 600, 0, 601)
    assert never.refused_by == "tokens" and never.retry_after_s == 0 and never.message
    assert decide(TenantLimits(requests_per_minute=0), 0, 0, 0, 1).message
    assert decide(TenantLimits(), 0, 0, 10**6, 10**9).allowed


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0ms"),
        (0.02, "20ms"),
        (0.0201, "21ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.9986, "59.999s"),
        (59.9994, "1m0s"),
        (360, "6m0s"),
        (61.25, "1m1.25s"),
        (3600, "1h0m0s"),
        (3725, "1h2m5s"),
    ],
)
def test_format_reset_like_openai(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_headers_floor_remaining_and_skip_unlimited() -> None:
    headers = ratelimit_headers(TenantLimits(requests_per_minute=10), 3.99, 6, 0, 0)
    assert headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "6s",
    }
