"""The HTTP edge, against a real server with auth on: every field bounded (400, never a 500), JSON
nested too deep, a body that stops arriving (408), console paths no file can have, who may read
/metrics and how tenants are labelled there."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from edge_server import HANG_S, METRICS_TOKEN, EdgeServer, admin_headers
from gateway_server import Server, start_server
from litestar.testing import TestClient

from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.settings import Settings
from observability.metrics import TenantLabel, TenantLabels

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(edge: EdgeServer, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{edge.base_url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, **body},
        headers=edge.tenant_headers(),
        timeout=HANG_S,
    )


def completion(edge: EdgeServer, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{edge.base_url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, **body},
        headers=edge.tenant_headers(),
        timeout=HANG_S,
    )


def assert_400(resp: httpx.Response, param: str | None) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


# -- bounds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seed": 2**64}, "seed"),  # once: a 500 from the msgpack encoder of the engine pipe
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 2**64}, "max_completion_tokens"),
        ({"top_k": 2**31}, "top_k"),
        ({"priority": 2**64}, "priority"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"frequency_penalty": -1e300}, "frequency_penalty"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["ok", "y" * 257]}, "stop[1]"),
        ({"model": "m" * 201}, "model"),
        ({"user": "u" * 257}, "user"),
        ({"messages": [{"role": "user", "content": "hi", "name": "n" * 257}]}, "messages[0].name"),
        ({"messages": MESSAGES * 4097}, "messages"),
    ],
)
def test_chat_fields_out_of_range_are_400(edge: EdgeServer, body: dict[str, Any], param: str) -> None:
    assert_400(chat(edge, **body), param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [2**64]}, "prompt[0]"),
        ({"prompt": [1, 2**31]}, "prompt[1]"),
        ({"prompt": [[1, 2], [3, -1]]}, "prompt[1][1]"),
        ({"prompt": "hi", "logprobs": 2**64}, "logprobs"),
        ({"prompt": "hi", "seed": 2**64, "n": 2}, "seed"),
    ],
)
def test_completion_fields_out_of_range_are_400(edge: EdgeServer, body: dict[str, Any], param: str) -> None:
    assert_400(completion(edge, **body), param)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_floats_are_400(edge: EdgeServer, literal: bytes) -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + b"}"
    resp = httpx.post(
        f"{edge.base_url}/v1/chat/completions",
        content=raw,
        headers={**edge.tenant_headers(), "content-type": "application/json"},
    )
    assert resp.status_code == 400, resp.text


def test_the_largest_seed_serves_every_choice(edge: EdgeServer) -> None:
    """Choice i samples with seed + i; at the top of the range that passes 2**63 and still works."""
    resp = chat(edge, seed=2**63 - 1, n=8)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 8
    assert completion(edge, seed=-(2**63), n=8).status_code == 200


# -- JSON nested too deep --------------------------------------------------------------------------


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "junk": %s}'),
        ("/v1/completions", b'{"prompt": "hi", "x": {"y": %s}}'),
        ("/admin/tenants", b'{"name": "deep", "junk": %s}'),  # a body Litestar decodes, not our handler
    ],
)
def test_json_nested_too_deep_is_400(edge: EdgeServer, path: str, body: bytes) -> None:
    headers = admin_headers() if path.startswith("/admin") else edge.tenant_headers()
    resp = httpx.post(
        edge.base_url + path, content=body % deep(1000), headers={**headers, "content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    assert "nested too deeply" in resp.json()["error"]["message"]


# -- a body that stops arriving --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/admin/tenants"])
def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(edge: EdgeServer, path: str) -> None:
    key = ADMIN_KEY_HEADER if path.startswith("/admin") else f"Bearer {edge.tenant_key}"
    url = urlsplit(edge.base_url)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
        f"authorization: {key}\r\ncontent-length: 100\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=HANG_S) as sock:
        sock.sendall(head.encode() + b'{"messages"')  # 11 of the 100 bytes promised, then nothing
        received = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), received
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "body_timeout" and error["type"] == "timeout_error"


ADMIN_KEY_HEADER = admin_headers()["authorization"]


@pytest.fixture(scope="module")
def slow_with_short_body_deadline() -> Iterator[Server]:
    """20 tokens/s and a 1 s body deadline: a 40-token answer takes twice the deadline."""
    yield from start_server(
        "--synthetic-tokens-per-second", "20", "--synthetic-ttft-ms", "1", env={"SLUICE_BODY_TIMEOUT_S": "1"}
    )


@pytest.mark.parametrize("stream", [False, True])
def test_the_body_deadline_never_cuts_a_generation(slow_with_short_body_deadline: Server, stream: bool) -> None:
    """Once the body is in, the handler keeps listening for a disconnect; that wait has no deadline."""
    body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": stream}
    resp = httpx.post(f"{slow_with_short_body_deadline.v1}/completions", json=body, timeout=HANG_S)
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.text.rstrip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in resp.text
    else:
        assert resp.json()["usage"]["completion_tokens"] == 40


# -- the console's static files --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/console/%00", "/console/a%00b/c.js", "/console/" + "n" * 5000])
def test_console_paths_no_file_can_have_are_404(edge: EdgeServer, path: str) -> None:
    resp = httpx.get(edge.base_url + path)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["type"] == "not_found_error"


# -- /metrics --------------------------------------------------------------------------------------


def scrape(edge: EdgeServer, authorization: str | None) -> httpx.Response:
    headers = {"authorization": authorization} if authorization else {}
    return httpx.get(f"{edge.base_url}/metrics", headers=headers)


def test_metrics_need_the_metrics_token_or_the_admin_key(edge: EdgeServer) -> None:
    for refused in (None, "Bearer wrong", f"Bearer {edge.tenant_key}", METRICS_TOKEN):
        resp = scrape(edge, refused)
        assert resp.status_code == 401, (refused, resp.text)
        assert resp.json()["error"]["type"] == "authentication_error"
        assert edge.tenant_id not in resp.text
    for allowed in (f"Bearer {METRICS_TOKEN}", ADMIN_KEY_HEADER):
        resp = scrape(edge, allowed)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("text/plain")
        assert "sluice_http_requests_total" in resp.text


def tenant_labels(text: str) -> set[str]:
    return set(re.findall(r'^sluice_requests_total\{[^}]*tenant="([^"]*)"', text, re.MULTILINE))


def test_metrics_label_tenants_by_name_when_so_configured(edge: EdgeServer) -> None:
    assert chat(edge).status_code == 200
    deadline = time.monotonic() + HANG_S  # the request is counted as it finishes, maybe after the reply
    labels: set[str] = set()
    while edge.tenant_name not in labels and time.monotonic() < deadline:
        time.sleep(0.05)
        text = scrape(edge, f"Bearer {METRICS_TOKEN}").text
        labels = tenant_labels(text)
    assert edge.tenant_name in labels
    assert edge.tenant_id not in text


def test_a_no_auth_server_with_a_metrics_token_still_needs_it() -> None:
    app = create_app(
        Settings(auth=False, metrics_token="t0k"), SyntheticDriver(model_name="synthetic")
    )
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"authorization": "Bearer t0k"}).status_code == 200
    # Without a token it stays open: no tenants to tell apart, and completions are open to all anyway.
    app = create_app(Settings(auth=False), SyntheticDriver(model_name="synthetic"))
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (TenantLabel.ID, ["t-1", "t-2", "other", "none"]),
        (TenantLabel.NAME, ["alpha", "beta", "other", "none"]),
        (TenantLabel.NONE, ["none", "none", "none", "none"]),
    ],
)
def test_tenant_labels_follow_the_setting(mode: TenantLabel, expected: list[str]) -> None:
    labels = TenantLabels(cap=2, mode=mode)
    for tenant, name in (("t-1", "alpha"), ("t-2", "beta"), ("t-3", "gamma")):
        labels.learn(tenant, name)  # as each caller authenticates, before its request is counted
    assert [labels(t) for t in ("t-1", "t-2", "t-3", None)] == expected
    labels.learn("t-1", "alpha-renamed")
    assert labels("t-1") == {TenantLabel.ID: "t-1", TenantLabel.NAME: "alpha-renamed"}.get(mode, "none")


def test_the_tenant_label_setting_is_read_and_checked() -> None:
    assert Settings.from_env({"SLUICE_METRICS_TENANT_LABEL": "Name"}).metrics_tenant_label == "name"
    with pytest.raises(ValueError, match="SLUICE_METRICS_TENANT_LABEL"):
        Settings.from_env({"SLUICE_METRICS_TENANT_LABEL": "email"})
