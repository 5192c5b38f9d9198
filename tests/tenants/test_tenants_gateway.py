"""The admin API, bearer auth, budgets and priority through the real app, in-process (SQLite; the
input-bound and usage-loss tests on PostgreSQL too)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from litestar.testing import TestClient
from sqlalchemy import select

from drivers.base import GenerationChunk, GenerationRequest
from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.settings import Settings
from tenants.db import create_engine
from tenants.models import UsageRecord

ADMIN = "test-admin-key"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
HANG_S = 60.0  # polls give up only after this: it catches hangs, not slowness
T = TypeVar("T")


def poll(fetch: Callable[[], T], done: Callable[[T], bool], what: str) -> T:
    """fetch() until done(result), for at most HANG_S."""
    deadline = time.monotonic() + HANG_S
    while not done(result := fetch()):
        assert time.monotonic() < deadline, f"still waiting for {what}: {result}"
        time.sleep(0.05)
    return result


class RecordingDriver(SyntheticDriver):
    """The synthetic engine, remembering every request it was handed."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.seen.append(request)
        return super().generate(request)


@pytest.fixture
def driver() -> RecordingDriver:
    return RecordingDriver(tokens_per_second=0, ttft_s=0)


@pytest.fixture
def client(tmp_path: Path, driver: RecordingDriver) -> Iterator[TestClient[Any]]:
    settings = Settings(data_dir=str(tmp_path), admin_key=ADMIN, usage_flush_interval_s=0.02)
    with TestClient(create_app(settings, driver)) as c:
        yield c


@pytest.fixture
def db_client(db_url: str, tmp_path: Path, driver: RecordingDriver) -> Iterator[TestClient[Any]]:
    """The app on the shared test database of each backend (other tests' tenants may be there)."""
    settings = Settings(data_dir=str(tmp_path), database_url=db_url, admin_key=ADMIN)
    with TestClient(create_app(settings, driver)) as c:
        yield c


def make_tenant(client: TestClient[Any], **fields: Any) -> tuple[str, dict[str, str]]:
    """A new tenant and the headers of a fresh key of it."""
    resp = client.post(
        "/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}", **fields}, headers=ADMIN_HEADERS
    )
    assert resp.status_code == 201, resp.text
    tenant_id: str = resp.json()["id"]
    key = client.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=ADMIN_HEADERS)
    assert key.status_code == 201, key.text
    return tenant_id, {"authorization": f"Bearer {key.json()['key']}"}


def usage_of(client: TestClient[Any], tenant_id: str) -> dict[str, Any]:
    resp = client.get(f"/admin/tenants/{tenant_id}/usage?group_by=model", headers=ADMIN_HEADERS)
    assert resp.status_code == 200, resp.text
    usage: dict[str, Any] = resp.json()
    return usage


def assert_error(resp: Any, status: int, type_: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["type"] == type_ and error["message"]
    return error


def test_admin_api_round_trip(client: TestClient[Any]) -> None:
    resp = client.post("/admin/tenants", json={"name": "round-trip"}, headers=ADMIN_HEADERS)
    tenant = resp.json()
    assert resp.status_code == 201 and tenant["priority"] == 1 and tenant["status"] == "active"
    assert tenant["weight"] == 1.0
    tid = tenant["id"]
    assert [t["id"] for t in client.get("/admin/tenants", headers=ADMIN_HEADERS).json()["data"]] == [tid]
    patched = client.patch(
        f"/admin/tenants/{tid}", json={"requests_per_minute": None, "priority": 0}, headers=ADMIN_HEADERS
    )
    assert (patched.json()["requests_per_minute"], patched.json()["priority"]) == (None, 0)
    assert client.get(f"/admin/tenants/{tid}", headers=ADMIN_HEADERS).json()["tokens_per_minute"] == 100_000
    created = client.post(
        f"/admin/tenants/{tid}/keys",
        json={"name": "ci", "expires_at": "2099-01-01T00:00:00Z"},
        headers=ADMIN_HEADERS,
    ).json()
    assert created["key"].startswith(created["prefix"]) and created["expires_at"].startswith("2099")
    listed = client.get(f"/admin/tenants/{tid}/keys", headers=ADMIN_HEADERS).json()["data"]
    assert [k["id"] for k in listed] == [created["id"]] and "key" not in listed[0]
    assert created["key"] not in client.get(f"/admin/tenants/{tid}/keys", headers=ADMIN_HEADERS).text
    revoked = client.delete(f"/admin/keys/{created['id']}", headers=ADMIN_HEADERS)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert client.delete(f"/admin/tenants/{tid}", headers=ADMIN_HEADERS).status_code == 204
    assert_error(client.get(f"/admin/tenants/{tid}", headers=ADMIN_HEADERS), 404, "not_found_error")


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("post", "/admin/tenants", {}, "name"),
        ("post", "/admin/tenants", {"name": ""}, "name"),
        ("post", "/admin/tenants", {"name": "x", "priority": 3}, "priority"),
        ("post", "/admin/tenants", {"name": "x", "requests_per_minute": 0}, "requests_per_minute"),
        ("post", "/admin/tenants", {"name": "x", "tokens_per_minute": "many"}, "tokens_per_minute"),
        ("post", "/admin/tenants", {"name": "x", "colour": "red"}, None),
        ("patch", "/admin/tenants/{tid}", {"status": "deleted"}, "status"),
        ("post", "/admin/tenants/{tid}/keys", {"name": "k", "expires_at": "tomorrow"}, "expires_at"),
        ("get", "/admin/tenants/{tid}/usage?group_by=week", None, "group_by"),
        ("get", "/admin/tenants/{tid}/usage?start=2030-01-02&end=2030-01-01", None, "start"),
    ],
)
def test_admin_validation_errors_are_400(
    client: TestClient[Any], method: str, path: str, body: dict[str, Any] | None, param: str | None
) -> None:
    tid, _ = make_tenant(client)
    kwargs: dict[str, Any] = {"headers": ADMIN_HEADERS}
    if body is not None:
        kwargs["json"] = body
    error = assert_error(
        getattr(client, method)(path.format(tid=tid), **kwargs), 400, "invalid_request_error"
    )
    if param is not None:
        assert error["param"] == param or param in error["message"]


def test_unknown_tenant_or_key_is_404(client: TestClient[Any]) -> None:
    for method, path in [
        ("get", "/admin/tenants/nope"),
        ("patch", "/admin/tenants/nope"),
        ("delete", "/admin/tenants/nope"),
        ("get", "/admin/tenants/nope/keys"),
        ("post", "/admin/tenants/nope/keys"),
        ("get", "/admin/tenants/nope/usage"),
        ("delete", "/admin/keys/nope"),
    ]:
        body = {"json": {"name": "k"}} if method in ("post", "patch") else {}
        assert_error(getattr(client, method)(path, headers=ADMIN_HEADERS, **body), 404, "not_found_error")
    assert client.post("/admin/tenants", json={"name": "dup"}, headers=ADMIN_HEADERS).status_code == 201
    assert client.post("/admin/tenants", json={"name": "dup"}, headers=ADMIN_HEADERS).status_code == 409


def test_auth_errors(client: TestClient[Any]) -> None:
    tid, headers = make_tenant(client, requests_per_minute=None)
    assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    error = assert_error(client.post("/v1/chat/completions", json=CHAT), 401, "authentication_error")
    assert "Authorization" in error["message"]
    for bad in ("Bearer sk-sluice-unknown", "Basic abc", "Bearer ", headers["authorization"] + "x"):
        assert_error(
            client.post("/v1/chat/completions", json=CHAT, headers={"authorization": bad}),
            401,
            "authentication_error",
        )
    assert_error(client.get("/v1/models"), 401, "authentication_error")
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    expired = client.post(
        f"/admin/tenants/{tid}/keys", json={"name": "old", "expires_at": past}, headers=ADMIN_HEADERS
    ).json()
    resp = client.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {expired['key']}"}
    )
    assert "expired" in assert_error(resp, 401, "authentication_error")["message"]
    # Suspension and reactivation reach the key cache within its TTL: polled, not slept for.
    client.patch(f"/admin/tenants/{tid}", json={"status": "suspended"}, headers=ADMIN_HEADERS)
    chat = lambda: client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert_error(poll(chat, lambda r: r.status_code != 200, "the suspension"), 403, "permission_error")
    client.patch(f"/admin/tenants/{tid}", json={"status": "active"}, headers=ADMIN_HEADERS)
    poll(chat, lambda r: r.status_code == 200, "the reactivation")


def test_tenants_see_only_their_own_usage_and_never_the_admin_api(client: TestClient[Any]) -> None:
    a, a_headers = make_tenant(client)
    b, b_headers = make_tenant(client)
    for _ in range(3):
        assert client.post("/v1/chat/completions", json=CHAT, headers=a_headers).status_code == 200
    assert (
        client.post(
            "/v1/completions", json={"prompt": "one two", "max_tokens": 2}, headers=b_headers
        ).status_code
        == 200
    )
    # Usage is written off the request path; polled through the admin API (not rate-limited).
    poll(lambda: usage_of(client, a), lambda u: u["total_tokens"] >= 3 * 9, "a's usage")
    usage = client.get("/v1/usage?group_by=model", headers=a_headers).json()
    assert usage["tenant_id"] == a and usage["data"][0]["requests"] == 3
    assert client.get("/v1/usage", headers=b_headers).json()["tenant_id"] == b
    for method, path in [
        ("get", f"/admin/tenants/{b}/usage"),
        ("get", f"/admin/tenants/{b}"),
        ("get", "/admin/tenants"),
        ("post", f"/admin/tenants/{a}/keys"),
        ("patch", f"/admin/tenants/{a}"),
    ]:
        body = {"json": {"name": "x"}} if method != "get" else {}
        assert_error(getattr(client, method)(path, headers=a_headers, **body), 403, "permission_error")
    assert_error(client.get(f"/admin/tenants/{b}/usage"), 401, "authentication_error")
    assert_error(
        client.get("/admin/tenants", headers={"authorization": "Bearer nope"}), 401, "authentication_error"
    )
    # b's record may land a flush after a's.
    b_usage = poll(lambda: usage_of(client, b), lambda u: u["total_tokens"] > 0, "b's usage")
    assert b_usage["tenant_id"] == b


def test_tier_becomes_the_driver_request_priority(client: TestClient[Any], driver: RecordingDriver) -> None:
    for tier in (0, 2, 1):
        tid, headers = make_tenant(client, priority=tier)
        body = {**CHAT, "n": 2}
        assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        assert [(r.priority, r.tenant_id) for r in driver.seen[-2:]] == [(tier, tid)] * 2


def test_rate_limit_headers_and_429(client: TestClient[Any]) -> None:
    _, headers = make_tenant(client, requests_per_minute=2, tokens_per_minute=10_000)
    ok = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers)
    assert streamed.status_code == 200 and streamed.headers["x-ratelimit-remaining-requests"] == "0"
    refused = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert assert_error(refused, 429, "rate_limit_error")["code"] == "rate_limit_exceeded"
    assert (
        int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
    )


def test_monthly_budget_exceeded_is_insufficient_quota(client: TestClient[Any]) -> None:
    _, headers = make_tenant(client, monthly_token_budget=20)
    body = {**CHAT, "max_tokens": 10}
    chat = lambda: client.post("/v1/chat/completions", json=body, headers=headers)
    resp = poll(chat, lambda r: r.status_code != 200, "the budget to run out")
    error = assert_error(resp, 429, "insufficient_quota")
    assert error["code"] == "insufficient_quota" and "budget" in error["message"]


def test_openapi_documents_admin_and_usage(client: TestClient[Any]) -> None:
    schema = client.get("/schema/openapi.json").json()
    paths = schema["paths"]
    assert {"post", "get"} <= set(paths["/admin/tenants"])
    assert {"get", "patch", "delete"} <= set(paths["/admin/tenants/{tenant_id}"])
    assert {"post", "get"} <= set(paths["/admin/tenants/{tenant_id}/keys"])
    assert "delete" in paths["/admin/keys/{key_id}"] and "get" in paths["/admin/tenants/{tenant_id}/usage"]
    assert "get" in paths["/v1/usage"]
    assert {"ApiKey", "AdminKey"} <= set(schema["components"]["securitySchemes"])
    assert "TenantCreate" in str(schema["components"]["schemas"])


def test_latency_percentiles_count_only_a_tenants_completed_requests(client: TestClient[Any]) -> None:
    a, a_headers = make_tenant(client, requests_per_minute=3)
    _, b_headers = make_tenant(client)
    for _ in range(4):  # three complete, the fourth is refused (429) and must not count
        client.post("/v1/chat/completions", json=CHAT, headers=a_headers)
    poll(lambda: usage_of(client, a), lambda u: sum(b["requests"] for b in u["data"]) >= 4, "a's usage")
    latency = client.get("/v1/usage/latency?group_by=model", headers=a_headers).json()
    assert latency["tenant_id"] == a and latency["overall"]["requests"] == 3
    assert [b["group"] for b in latency["data"]] == ["synthetic"] and not latency["truncated"]
    p = latency["overall"]["latency_ms"]
    assert 0 <= p["p50"] <= p["p90"] <= p["p99"]
    assert latency["overall"]["ttft_ms"]["p50"] <= p["p99"]
    admin_view = client.get(f"/admin/tenants/{a}/latency?group_by=model", headers=ADMIN_HEADERS).json()
    assert (admin_view["data"], admin_view["overall"]) == (latency["data"], latency["overall"])
    assert client.get("/v1/usage/latency", headers=b_headers).json()["overall"] == {
        "group": "all",
        "requests": 0,
        "ttft_ms": None,
        "latency_ms": None,
    }
    assert_error(client.get(f"/admin/tenants/{a}/latency", headers=b_headers), 403, "permission_error")
    assert_error(client.get("/v1/usage/latency"), 401, "authentication_error")
    models = client.get("/admin/models", headers=ADMIN_HEADERS).json()["data"]
    assert [m["id"] for m in models] == [
        m["id"] for m in client.get("/v1/models", headers=a_headers).json()["data"]
    ]


def test_first_start_prints_working_keys_once(tmp_path: Path, driver: RecordingDriver, capsys: Any) -> None:
    settings = Settings(data_dir=str(tmp_path), admin_key=None)
    with TestClient(create_app(settings, driver)) as c:
        printed = capsys.readouterr().out
        lines = [line.strip() for line in printed.splitlines()]
        admin_key = lines[lines.index(next(x for x in lines if x.startswith("Generated the admin key"))) + 1]
        tenant_key = lines[lines.index("Created tenant 'default' with an API key (shown once):") + 1]
        assert f"Bearer {tenant_key}" in printed  # the curl example carries the real key
        ok = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {tenant_key}"})
        assert ok.status_code == 200, ok.text
        tenants = c.get("/admin/tenants", headers={"authorization": f"Bearer {admin_key}"})
        assert [t["name"] for t in tenants.json()["data"]] == ["default"]
    with TestClient(create_app(settings, driver)):
        assert "Generated" not in capsys.readouterr().out  # shown once: the second start prints nothing


# -- fair-share weight -------------------------------------------------------------------------------


def test_weight_is_set_shown_and_patched(client: TestClient[Any]) -> None:
    """(TenantContext.weight is checked in test_tenants_service.py.)"""
    tid, _ = make_tenant(client, weight=2.5)
    assert client.get(f"/admin/tenants/{tid}", headers=ADMIN_HEADERS).json()["weight"] == 2.5
    patched = client.patch(f"/admin/tenants/{tid}", json={"weight": 0.25}, headers=ADMIN_HEADERS)
    assert patched.status_code == 200 and patched.json()["weight"] == 0.25
    listed = client.get("/admin/tenants", headers=ADMIN_HEADERS).json()["data"]
    assert [t["weight"] for t in listed if t["id"] == tid] == [0.25]
    for weight in (0, -1, 0.0001, 1e9, "heavy", None):
        resp = client.patch(f"/admin/tenants/{tid}", json={"weight": weight}, headers=ADMIN_HEADERS)
        assert assert_error(resp, 400, "invalid_request_error")["param"] == "weight" or "weight" in resp.text
    schema = client.get("/schema/openapi.json").json()["components"]["schemas"]
    weight = schema["TenantCreate"]["properties"]["weight"]
    assert (weight["minimum"], weight["maximum"], weight["default"]) == (0.001, 1000.0, 1.0)


def test_the_tenants_weight_reaches_the_engine_request(client: TestClient[Any], driver: RecordingDriver) -> None:
    """The weight travels with every request of the tenant to the driver, and from there to the
    scheduler's fair share (tests/engine/test_scheduler_fair_share.py)."""
    _, headers = make_tenant(client, weight=2.5)
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=headers).status_code == 200
    assert [r.tenant_weight for r in driver.seen] == [2.5, 2.5]


# -- input bounds: what a bounded schema fuzz of the admin API turned into 500s -----------------------

DEEP = '{"name": "deep", "z": ' + "[" * 1000 + "]" * 1000 + "}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("requests_per_minute", 2**53),  # beyond what a JSON double (and the Redis limiter) holds exactly
        ("tokens_per_minute", 2**70),
        ("max_concurrent", 3_000_000_000),  # a 32-bit column
        ("monthly_token_budget", 2**63),
        ("name", "nul\x00byte"),  # PostgreSQL refuses NUL in text
        ("name", "\x00"),
        ("name", "trailing newline\n"),
        ("name", "tab\tinside"),
        ("name", "x" * 201),
        ("weight", 0),
    ],
)
def test_out_of_range_tenant_fields_are_400_not_500(
    db_client: TestClient[Any], field: str, value: Any
) -> None:
    """Before (PostgreSQL): the integers overflowed their columns and NUL was refused by the server:
    500 from POST /admin/tenants and PATCH."""
    body = {"name": f"t-{uuid.uuid4().hex[:8]}", field: value}
    created = db_client.post("/admin/tenants", json=body, headers=ADMIN_HEADERS)
    assert assert_error(created, 400, "invalid_request_error")["param"] == field
    tid, _ = make_tenant(db_client)
    patched = db_client.patch(f"/admin/tenants/{tid}", json={field: value}, headers=ADMIN_HEADERS)
    assert assert_error(patched, 400, "invalid_request_error")["param"] == field


def test_limits_beyond_32_bits_are_kept(db_client: TestClient[Any]) -> None:
    """Before (PostgreSQL): `requests_per_minute: 3000000000` was a 500 (a 32-bit column)."""
    big = {
        "requests_per_minute": 3_000_000_000,
        "tokens_per_minute": 2**53 - 1,
        "monthly_token_budget": 2**53 - 1,
    }
    tid, headers = make_tenant(db_client, **big)
    shown = db_client.get(f"/admin/tenants/{tid}", headers=ADMIN_HEADERS).json()
    assert {k: shown[k] for k in big} == big
    assert db_client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    patched = db_client.patch(
        f"/admin/tenants/{tid}", json={"requests_per_minute": 2**40}, headers=ADMIN_HEADERS
    )
    assert patched.json()["requests_per_minute"] == 2**40


def test_unusable_ids_datetimes_and_key_names_are_client_errors(db_client: TestClient[Any]) -> None:
    """Before: a NUL in a path id reached PostgreSQL (500); an expiry or report bound whose UTC
    leaves year 9999 overflowed (500 on both backends); a NUL key name was refused by PostgreSQL."""
    tid, _ = make_tenant(db_client)
    for method, path in [
        ("get", "/admin/tenants/%00"),
        ("patch", "/admin/tenants/a%00b"),
        ("delete", "/admin/tenants/%00"),
        ("get", "/admin/tenants/%00/keys"),
        ("get", "/admin/tenants/%00/usage"),
        ("delete", "/admin/keys/%00"),
        ("get", "/admin/tenants/" + "x" * 300),
    ]:
        body = {"json": {"name": "k"}} if method == "patch" else {}
        resp = getattr(db_client, method)(path, headers=ADMIN_HEADERS, **body)
        assert_error(resp, 404, "not_found_error")
    for expires_at in ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+05:00", "2030-01-01T00:00:00"):
        resp = db_client.post(
            f"/admin/tenants/{tid}/keys", json={"name": "k", "expires_at": expires_at}, headers=ADMIN_HEADERS
        )
        assert assert_error(resp, 400, "invalid_request_error")["param"] == "expires_at"
    resp = db_client.post(f"/admin/tenants/{tid}/keys", json={"name": "k\x00"}, headers=ADMIN_HEADERS)
    assert assert_error(resp, 400, "invalid_request_error")["param"] == "name"
    for query in ("start=0001-01-01T00:00:00%2B05:00", "end=9999-12-31T23:59:59-05:00"):
        for report in ("usage", "latency"):
            resp = db_client.get(f"/admin/tenants/{tid}/{report}?{query}", headers=ADMIN_HEADERS)
            assert_error(resp, 400, "invalid_request_error")


def test_a_body_nested_too_deeply_is_400(client: TestClient[Any]) -> None:
    """Before: Litestar's untyped decode hit msgspec's recursion guard: RecursionError, 500."""
    tid, _ = make_tenant(client)
    for method, path in [
        ("post", "/admin/tenants"),
        ("patch", f"/admin/tenants/{tid}"),
        ("post", f"/admin/tenants/{tid}/keys"),
    ]:
        resp = getattr(client, method)(
            path, content=DEEP, headers={**ADMIN_HEADERS, "content-type": "application/json"}
        )
        assert "nested too deeply" in assert_error(resp, 400, "invalid_request_error")["message"]


# -- usage: never lost to one client's input, reports rate-limited ------------------------------------


def test_an_unknown_model_of_any_name_costs_no_other_tenant_its_usage(
    db_url: str, tmp_path: Path, driver: RecordingDriver
) -> None:
    """Before (PostgreSQL): the model name was written raw into VARCHAR(200); the batch failed three
    times and was dropped with every other tenant's rows in it. SQLite stored it unbounded."""
    settings = Settings(
        data_dir=str(tmp_path), database_url=db_url, admin_key=ADMIN, usage_flush_interval_s=3600.0
    )
    with TestClient(create_app(settings, driver)) as c:  # one batch: written only at shutdown
        good, good_headers = make_tenant(c)
        bad, bad_headers = make_tenant(c)
        # A name past the schema's 200 characters is refused at the edge (400, before auth: no usage
        # row); one that fits but holds a NUL reaches the gate and is refused there (404, a usage row).
        for model in ("m" * 10_000, "nul\x00model"):
            resp = c.post("/v1/chat/completions", json={**CHAT, "model": model}, headers=bad_headers)
            assert resp.status_code in (400, 404), resp.text
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=CHAT, headers=good_headers).status_code == 200
    rows = asyncio.run(_usage_rows(db_url, (good, bad)))
    assert [r.status for r in rows if r.tenant_id == good] == ["ok"] * 3
    refused = [r.model for r in rows if r.tenant_id == bad]
    assert len(refused) == 1 and all(len(m) <= 200 and "\x00" not in m for m in refused)


async def _usage_rows(url: str, tenants: tuple[str, ...]) -> list[UsageRecord]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            query = select(UsageRecord).where(UsageRecord.tenant_id.in_(tenants))
            return list((await conn.execute(query)).all())  # type: ignore[arg-type]
    finally:
        await engine.dispose()


def test_usage_reports_are_rate_limited_per_key(client: TestClient[Any]) -> None:
    tid, headers = make_tenant(client)
    key2 = client.post(f"/admin/tenants/{tid}/keys", json={"name": "k2"}, headers=ADMIN_HEADERS).json()["key"]
    limiter = client.app.state["tenancy"].reports
    now = [0.0]
    limiter.clock = lambda: now[0]  # frozen: no refill while the test runs, however slowly
    per_minute = limiter.config.per_minute
    for i in range(per_minute):
        path = "/v1/usage" if i % 2 else "/v1/usage/latency"
        assert client.get(path, headers=headers).status_code == 200
    refused = client.get("/v1/usage/latency", headers=headers)
    assert assert_error(refused, 429, "rate_limit_error")["code"] == "rate_limit_exceeded"
    assert refused.headers["retry-after"] == "1"  # one report refills in 60 / per_minute s
    assert client.get("/v1/usage", headers={"authorization": f"Bearer {key2}"}).status_code == 200
    assert client.get(f"/admin/tenants/{tid}/latency", headers=ADMIN_HEADERS).status_code == 200
    now[0] += 60.0 / per_minute
    assert client.get("/v1/usage", headers=headers).status_code == 200
    assert client.get("/v1/usage", headers=headers).status_code == 429


def test_usage_writer_counters_are_exported(client: TestClient[Any]) -> None:
    _, headers = make_tenant(client)
    assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200

    def written() -> float:
        lines = client.get("/metrics", headers=ADMIN_HEADERS).text.splitlines()
        return float(
            next(line.split()[1] for line in lines if line.startswith("sluice_usage_rows_written_total"))
        )

    poll(written, lambda n: n >= 1, "the usage row to be written")
    text = client.get("/metrics", headers=ADMIN_HEADERS).text
    for name in ("rejected_total", "overflowed_total", "lost_total", "buffered"):
        assert f"sluice_usage_rows_{name} 0.0" in text
