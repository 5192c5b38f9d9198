"""Two `sluice serve` replicas sharing one PostgreSQL database and one Redis: limits, refunds,
revocation and suspension cross replicas; usage rows match the responses after a clean shutdown."""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from gateway_server import Server, start_server
from sqlalchemy import select

from tenants.db import create_engine, create_postgres_database, drop_postgres_database
from tenants.models import UsageRecord

PG_SERVER = os.environ.get("SLUICE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN = {"authorization": "Bearer replica-admin-key"}
# 96% of synthetic words hold one of these (the API takes at most 4 stop strings): completions stop at once.
VOWELS = ["a", "e", "i", "o"]
HANG_S = 60.0  # deadlines only catch hangs; how fast things happen is for the benchmarks


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    url = f"{PG_SERVER.rsplit('/', 1)[0]}/sluice_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_postgres_database(url))
    try:
        yield url
    finally:
        asyncio.run(drop_postgres_database(url))


def replicas(database: str, count: int = 2, **env: str) -> Iterator[list[Server]]:
    environment = {
        "DATABASE_URL": database,
        "REDIS_URL": REDIS_URL,
        "SLUICE_ADMIN_KEY": ADMIN["authorization"].split()[1],
        # Others load these 2 CPUs: a generous Redis timeout, and fail closed so an outage shows as a
        # 503 failure here instead of slipping through as an admission.
        "SLUICE_RATELIMIT_TIMEOUT_MS": "5000",
        "SLUICE_RATELIMIT_FAIL_MODE": "closed",
        **env,
    }
    options = ("--synthetic-tokens-per-second", "0", "--synthetic-ttft-ms", "1", "--max-model-len", "2048")
    with ExitStack() as stack:
        servers = []
        for _ in range(count):
            gen = start_server(*options, auth=True, env=environment)
            servers.append(next(gen))
            stack.callback(lambda g=gen: next(g, None))  # runs start_server's finally: terminate
        yield servers


@pytest.fixture(scope="module")
def pair(database: str) -> Iterator[list[Server]]:
    yield from replicas(database)


def new_tenant(server: Server, **limits: Any) -> tuple[str, str, str]:
    """(tenant id, key id, secret) of a fresh tenant created through `server`'s admin API."""
    body = {"name": f"t-{uuid.uuid4().hex[:10]}", "max_concurrent": None, **limits}
    tenant = httpx.post(f"{server.base_url}/admin/tenants", json=body, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(
        f"{server.base_url}/admin/tenants/{tenant.json()['id']}/keys", json={"name": "k"}, headers=ADMIN
    )
    assert key.status_code == 201, key.text
    return tenant.json()["id"], key.json()["id"], key.json()["key"]


def chat(server: Server, secret: str, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, **extra}
    return httpx.post(
        f"{server.v1}/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}, timeout=30
    )


def test_concurrent_requests_across_replicas_admit_exactly_the_bucket(pair: list[Server]) -> None:
    n, m = 7, 40
    _, _, secret = new_tenant(pair[0], requests_per_minute=n, tokens_per_minute=1_000_000)
    started = time.monotonic()
    with ThreadPoolExecutor(m) as pool:
        responses = list(pool.map(lambda i: chat(pair[i % 2], secret), range(m)))
    # The bucket refills n per minute: on a slow machine the burst may outlast a refill or two.
    refilled = math.floor((time.monotonic() - started) * n / 60)
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == m, [r.status_code for r in responses]
    assert n <= len(ok) <= n + refilled, [r.status_code for r in responses]
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == str(n)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert all(r.headers["x-ratelimit-limit-requests"] == str(n) for r in ok)


def test_refund_of_a_short_completion_is_visible_on_the_other_replica(pair: list[Server]) -> None:
    _, _, secret = new_tenant(pair[0], requests_per_minute=1000, tokens_per_minute=1000)
    # Reserves prompt + 900 on replica 0 but stops after one token: nearly all of it comes back.
    short = chat(pair[0], secret, max_tokens=900, stop=VOWELS)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] < 10
    # Only admissible on replica 1 if the refund reached the shared bucket.
    full = chat(pair[1], secret, max_tokens=900)
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["completion_tokens"] == 900
    # That one used all it reserved: nothing comes back, so the next reservation does not fit.
    assert chat(pair[0], secret, max_tokens=900).status_code == 429


def until_refused(server: Server, secret: str, what: str) -> httpx.Response:
    """Chat through `server` until it stops answering 200. The key cache bounds how long that takes
    (SLUICE_AUTH_CACHE_TTL_S, 1 s); the deadline here only catches a replica that never notices."""
    deadline = time.monotonic() + HANG_S
    while (resp := chat(server, secret)).status_code == 200:
        assert time.monotonic() < deadline, f"{what} never reached the other replica"
        time.sleep(0.05)
    return resp


def test_revocation_and_suspension_reach_the_other_replica(pair: list[Server]) -> None:
    _, key_id, secret = new_tenant(pair[0], requests_per_minute=None)
    _, _, other_secret = new_tenant(pair[0])
    assert chat(pair[1], secret).status_code == 200  # replica 1 now has the key cached
    assert httpx.delete(f"{pair[0].base_url}/admin/keys/{key_id}", headers=ADMIN).status_code == 200
    assert until_refused(pair[1], secret, "the revocation").status_code == 401

    tenant2, _, secret2 = new_tenant(pair[0], requests_per_minute=None)
    assert chat(pair[1], secret2).status_code == 200
    httpx.patch(f"{pair[0].base_url}/admin/tenants/{tenant2}", json={"status": "suspended"}, headers=ADMIN)
    resp = until_refused(pair[1], secret2, "the suspension")
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "permission_error"
    assert chat(pair[1], other_secret).status_code == 200  # other tenants are unaffected


def test_usage_rows_equal_reported_usage_after_clean_shutdown(database: str) -> None:
    # Flushes only every minute: the rows can only get there through the shutdown flush.
    gen = replicas(database, SLUICE_USAGE_FLUSH_MS="60000")
    servers = next(gen)
    try:
        tenant_id, key_id, secret = new_tenant(servers[0], requests_per_minute=None, tokens_per_minute=None)
        reported: dict[str, tuple[int, int]] = {}

        def one(i: int) -> None:
            server = servers[i % 2]
            if i % 3 == 0:  # streamed, with the usage chunk at the end
                body = {"stream": True, "stream_options": {"include_usage": True}}
                resp = chat(server, secret, max_tokens=1 + i % 9, **body)
                usage = [e for e in resp.text.split("\n\n") if '"usage":{' in e][-1]
                data = httpx.Response(200, content=usage.removeprefix("data: ")).json()
                reported[data["id"]] = (data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"])
                return
            resp = chat(server, secret, max_tokens=1 + i % 9, **({"stop": VOWELS} if i % 5 == 0 else {}))
            assert resp.status_code == 200, resp.text
            data = resp.json()
            reported[data["id"]] = (data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"])

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(100)))
        assert len(reported) == 100
        for server in servers:  # SIGTERM: uvicorn's graceful shutdown runs the app's lifespan exit
            server.process.terminate()
        for server in servers:
            # uvicorn re-raises the signal after its graceful shutdown, hence -SIGTERM and not 0
            assert server.process.wait(HANG_S) in (0, -15)
    finally:
        next(gen, None)
    rows = asyncio.run(_usage_rows(database, tenant_id))
    assert {r.request_id: (r.prompt_tokens, r.completion_tokens) for r in rows} == reported
    assert len(rows) == 100 and all(r.status == "ok" and r.key_id == key_id for r in rows)
    assert all(r.latency_ms >= 0 and r.ttft_ms is not None for r in rows)


async def _usage_rows(database: str, tenant_id: str) -> list[UsageRecord]:
    engine = create_engine(database)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id))
            return list(result.all())  # type: ignore[arg-type]
    finally:
        await engine.dispose()
