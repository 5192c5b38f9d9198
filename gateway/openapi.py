"""What the OpenAPI schema (/schema/openapi.json) says beyond what Litestar infers from signatures.

- Errors: every status an operation can answer with, each with the one error body `gateway.errors`
  sends (`ErrorBody`), instead of Litestar's own validation-error shape, which we never send.
- Bodies the handler decodes itself: the completion endpoints read and decode their body with
  msgspec (for errors that name the field, and the body deadline), so Litestar sees no `data`
  parameter to document. `SelfDecodedBody` states the body from the same msgspec type, with the
  same bounds, and adds the `text/event-stream` form of a streamed answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)

from gateway.schemas import ErrorBody

ERROR_STATUSES: dict[int, str] = {
    400: "Invalid request: a field out of range or of the wrong type, malformed JSON, a prompt that does "
    "not fit the context",
    401: "Missing, unknown, revoked or expired key",
    403: "A valid key that may not do this: a suspended tenant, or a tenant key on the admin API",
    404: "No such model, tenant or key",
    408: "The request body did not arrive within SLUICE_BODY_TIMEOUT_S; the connection is closed",
    409: "Conflicts with existing data, e.g. a tenant name already taken, a stale model alias generation, "
    "retiring a version an alias points at",
    422: "A model version that cannot be deployed here; `code` says why (missing_source, "
    "unsupported_architecture, over_budget, invalid_source, load_failed); nothing serving changed",
    413: "The request body is larger than SLUICE_MAX_BODY_BYTES",
    429: "A per-minute or concurrency limit (code rate_limit_exceeded, with Retry-After) or the monthly "
    "token budget (code insufficient_quota)",
    500: "A bug: logged with the request id",
    503: "Overloaded (Retry-After), no engine running, the model still loading, or the rate-limit store "
    "unreachable with SLUICE_RATELIMIT_FAIL_MODE=closed",
    504: "The generation ran past SLUICE_STREAM_TIMEOUT_S",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """`responses=` for a route decorator: these statuses, each with the OpenAI error body."""
    return {
        status: ResponseSpec(ErrorBody, description=ERROR_STATUSES[status], generate_examples=False)
        for status in (*statuses, 500)
    }


SSE_DESCRIPTION = (
    "With `stream: true`: server-sent events, one `data: <chunk JSON>` line per event (the same object "
    "as the JSON answer, holding a delta; a `usage` chunk last with `stream_options.include_usage`), "
    "ended by `data: [DONE]`. An error after the stream began arrives as `data: {\"error\": {...}}`."
)


def self_decoded_body(body: type[msgspec.Struct]) -> type[Operation]:
    """An `operation_class=` for a handler that decodes `body` itself and may answer 200 as SSE."""
    request_body = RequestBody(
        content={"application/json": OpenAPIMediaType(schema=_schema_of(body))}, required=True
    )
    # Before OpenAPI 3.2 (no `itemSchema`) an event stream's `schema` describes one event, and schema
    # checkers (schemathesis) validate each parsed event against it: an object, its `data` a string.
    event_stream = OpenAPIMediaType(schema=Schema(
        type=OpenAPIType.OBJECT,
        description=SSE_DESCRIPTION,
        properties={
            "data": Schema(type=OpenAPIType.STRING, description="a chunk's JSON, an error's JSON, or [DONE]"),
            "event": Schema(type=OpenAPIType.STRING),
        },
        required=["data"],
    ))

    @dataclass
    class SelfDecodedBody(Operation):
        def __post_init__(self) -> None:
            self.request_body = request_body
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse) and ok.content is not None:
                ok.content["text/event-stream"] = event_stream

    return SelfDecodedBody


def _schema_of(struct: type[msgspec.Struct]) -> Schema:
    """msgspec's JSON schema of `struct` (what its decoder enforces, bounds included) as one inline
    Litestar `Schema`: `$defs` references are resolved in place, as our request types do not recurse."""
    document = msgspec.json.schema(struct)
    defs: dict[str, Any] = document.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
        return {key: resolve(value) for key, value in node.items()}

    return _to_litestar(resolve(document))


_NESTED_LISTS = {"anyOf", "oneOf", "allOf"}
_CAMEL = re.compile(r"(?<!^)([A-Z])")


def _to_litestar(node: dict[str, Any]) -> Schema:
    fields: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            value = {name: _to_litestar(sub) for name, sub in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            value = _to_litestar(value)
        elif key in _NESTED_LISTS:
            value = [_to_litestar(sub) for sub in value]
        elif key == "type":
            value = [OpenAPIType(t) for t in value] if isinstance(value, list) else OpenAPIType(value)
        fields[_CAMEL.sub(r"_\1", key).lower()] = value
    return Schema(**fields)
