"""Fixtures for the rate-limit tests: both backends on the real local Redis (db 15, a prefix per test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from ratelimit_support import REDIS_URL, Backend, PrivateRedis, delete_prefix, private_redis


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError as exc:  # the tests need a real Redis: say so rather than skip
        pytest.fail(f"no Redis at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Backend]:
    spec = Backend(request.param)
    yield spec
    delete_prefix(redis_url, spec.prefix)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    spec = Backend("redis")
    yield spec.prefix
    delete_prefix(redis_url, spec.prefix)


@pytest.fixture
def spare_redis() -> Iterator[PrivateRedis]:
    yield from private_redis()
