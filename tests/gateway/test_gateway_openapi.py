"""The OpenAPI schema a real server serves is complete and true: the completion endpoints' request
bodies with their bounds, every error status each operation answers with, in the error body it
really sends, and the event-stream form of a streamed answer."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema_rs
import pytest
from edge_server import EdgeServer, admin_headers

ERRORS_OF_A_GENERATION = {"400", "401", "403", "404", "408", "413", "429", "500", "503", "504"}
ERROR_BODY = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture(scope="module")
def schema(edge: EdgeServer) -> dict[str, Any]:
    resp = httpx.get(f"{edge.base_url}/schema/openapi.json")
    assert resp.status_code == 200
    document: dict[str, Any] = resp.json()
    return document


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, item in schema["paths"].items() for method, op in item.items()]


def conforms(schema: dict[str, Any], sub_schema: dict[str, Any], instance: Any) -> bool:
    """Whether `instance` is valid against `sub_schema`, its $refs resolved in the served document."""
    return bool(jsonschema_rs.validator_for({**sub_schema, "components": schema["components"]}).is_valid(instance))


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_the_completion_endpoints_document_their_request_body(
    schema: dict[str, Any], path: str, field: str
) -> None:
    body = schema["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    shape = body["content"]["application/json"]["schema"]
    assert field in shape["required"]
    properties = shape["properties"]
    seed = next(s for s in properties["seed"]["anyOf"] if s["type"] == "integer")
    assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)
    assert next(s for s in properties["n"]["anyOf"] if s["type"] == "integer")["maximum"] == 8  # or null
    assert next(s for s in properties["model"]["anyOf"] if s["type"] == "string")["maxLength"] == 200
    items = properties[field] if field == "messages" else next(
        s for s in properties[field]["anyOf"] if s["type"] == "array"
    )
    assert items["minItems"] == 1 and items["maxItems"] in (4096, 1 << 20)
    # The same bounds as the decoder's: a body the schema accepts is served, one it refuses is a 400.
    good = {"messages": [{"role": "user", "content": "hi"}]} if field == "messages" else {"prompt": "hi"}
    assert conforms(schema, shape, {**good, "max_tokens": 2})
    assert not conforms(schema, shape, {**good, "seed": 2**63})
    assert not conforms(schema, shape, {"max_tokens": 2})


def test_a_streamed_answer_is_documented_as_an_event_stream(schema: dict[str, Any]) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)
        assert content["application/json"]["schema"]["$ref"].endswith(("/ChatCompletion", "/Completion"))


def test_every_error_status_is_documented_with_the_error_body(schema: dict[str, Any]) -> None:
    documented: dict[tuple[str, str], set[str]] = {}
    for method, path, op in operations(schema):
        errors = {status for status in op["responses"] if int(status) >= 400}
        documented[(method, path)] = errors
        for status in errors:
            content = op["responses"][status]["content"]
            assert content == {"application/json": {"schema": ERROR_BODY}}, (method, path, status)
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert ERRORS_OF_A_GENERATION <= documented[("post", path)], path
    assert {"401", "403"} <= documented[("get", "/v1/models")]
    assert {"400", "401", "403", "408", "409", "413"} <= documented[("post", "/admin/tenants")]
    assert {"404", "409"} <= documented[("patch", "/admin/tenants/{tenant_id}")]
    assert {"404"} <= documented[("delete", "/admin/keys/{key_id}")]
    assert {"401"} <= documented[("get", "/metrics")]
    error_detail = schema["components"]["schemas"]["ErrorDetail"]
    assert {"message", "type", "param", "code"} == set(error_detail["properties"])


def test_real_error_responses_match_the_documented_error_body(edge: EdgeServer, schema: dict[str, Any]) -> None:
    chat = f"{edge.base_url}/v1/chat/completions"
    tenant, admin = edge.tenant_headers(), admin_headers()
    real = [
        ("post", "/v1/chat/completions", httpx.post(chat, json={"messages": []}, headers=tenant)),
        ("post", "/v1/chat/completions", httpx.post(chat, json={"messages": []})),
        ("post", "/v1/chat/completions",
         httpx.post(chat, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}, headers=tenant)),
        ("post", "/v1/chat/completions", httpx.post(chat, content=b" " * (2 << 20), headers=tenant)),
        ("get", "/v1/models", httpx.get(f"{edge.base_url}/v1/models", headers=admin)),
        ("post", "/admin/tenants", httpx.post(f"{edge.base_url}/admin/tenants", json={"name": edge.tenant_name},
                                              headers=admin)),
        ("post", "/admin/tenants", httpx.post(f"{edge.base_url}/admin/tenants", json={"name": 5}, headers=admin)),
        ("post", "/admin/tenants", httpx.post(f"{edge.base_url}/admin/tenants", json={"name": "x"}, headers=tenant)),
        ("get", "/admin/tenants/{tenant_id}", httpx.get(f"{edge.base_url}/admin/tenants/nope", headers=admin)),
        ("get", "/metrics", httpx.get(f"{edge.base_url}/metrics")),
    ]
    statuses = set()
    for method, path, resp in real:
        status = str(resp.status_code)
        statuses.add(status)
        documented = schema["paths"][path][method]["responses"]
        assert status in documented, (method, path, resp.status_code, resp.text)
        assert resp.headers["content-type"].startswith("application/json")
        assert conforms(schema, documented[status]["content"]["application/json"]["schema"], resp.json()), resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert {"400", "401", "403", "404", "409", "413"} <= statuses
