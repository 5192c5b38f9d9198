"""The admin API, bearer auth, budgets and priority through the real app, in-process (SQLite)."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from drivers.base import GenerationChunk, GenerationRequest
from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.settings import Settings

ADMIN = "test-admin-key"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


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


def assert_error(resp: Any, status: int, type_: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["type"] == type_ and error["message"]
    return error


def test_admin_api_round_trip(client: TestClient[Any]) -> None:
    resp = client.post("/admin/tenants", json={"name": "round-trip"}, headers=ADMIN_HEADERS)
    tenant = resp.json()
    assert resp.status_code == 201 and tenant["priority"] == 1 and tenant["status"] == "active"
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
    tid, headers = make_tenant(client)
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
    client.patch(f"/admin/tenants/{tid}", json={"status": "suspended"}, headers=ADMIN_HEADERS)
    time.sleep(1.1)  # the key cache TTL
    assert_error(client.post("/v1/chat/completions", json=CHAT, headers=headers), 403, "permission_error")
    client.patch(f"/admin/tenants/{tid}", json={"status": "active"}, headers=ADMIN_HEADERS)
    time.sleep(1.1)
    assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200


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
    deadline = time.monotonic() + 5
    while (usage := client.get("/v1/usage?group_by=model", headers=a_headers).json())["total_tokens"] < 3 * 9:
        assert time.monotonic() < deadline, usage
        time.sleep(0.05)
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
    # Usage is written off the request path: b's record may land a flush after a's.
    deadline = time.monotonic() + 5
    while (b_usage := client.get(f"/admin/tenants/{b}/usage", headers=ADMIN_HEADERS).json())["total_tokens"] == 0:
        assert time.monotonic() < deadline, b_usage
        time.sleep(0.05)
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
    deadline = time.monotonic() + 10
    while (resp := client.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
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
    deadline = time.monotonic() + 5
    while sum(b["requests"] for b in client.get("/v1/usage", headers=a_headers).json()["data"]) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
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
