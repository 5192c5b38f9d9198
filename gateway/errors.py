"""The one place errors become HTTP responses, all in OpenAI's error format.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Driver errors (the typed taxonomy in `drivers.base`) and tenant errors (auth,
limits, admin: `tenants.errors`) map by class; Litestar's
own HTTP errors (unknown route, wrong method, body too large) keep their status
but get our body; a body that does not arrive in time is 408 and closes the
connection; a body nested too deep to decode is 400; anything else is a bug:
500, logged with the request id.
"""

from __future__ import annotations

import logging
import math
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap

from drivers.base import (
    DriverError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
)
from drivers.hosting import DeployRefusedError
from gateway.body_timeout import BodyTimeoutError
from gateway.fanout import LifetimeExceededError
from gateway.schemas import ErrorBody, ErrorDetail
from tenants.errors import (
    AuthenticationError,
    ConflictError,
    InvalidInputError,
    LimiterUnavailableError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitedError,
    TenantError,
)
from versions.errors import (
    InvalidRegistryInputError,
    NoHostError,
    RegistryConflictError,
    RegistryError,
    UnknownModelError,
)

log = logging.getLogger("sluice.gateway")

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed_error",
    408: "timeout_error",
    413: "request_too_large_error",
}
_FIELD_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


def request_id_of(request: Request) -> str | None:
    rid = request.state.get("request_id")
    return rid if isinstance(rid, str) else None


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
    request_id: str | None = None,
) -> Response[bytes]:
    body = msgspec.json.encode(ErrorBody(ErrorDetail(message=message, type=type_, param=param, code=code)))
    all_headers = dict(headers or {})
    if request_id:
        all_headers["x-request-id"] = request_id
    return Response(content=body, status_code=status, media_type="application/json", headers=all_headers)


def error_from_driver(
    exc: DriverError, request_id: str | None = None
) -> tuple[int, ErrorDetail, dict[str, str]]:
    """Status, body and headers for a driver error; also used for errors inside an open stream."""
    if isinstance(exc, InvalidRequestError):
        return 400, ErrorDetail(str(exc), "invalid_request_error", exc.param), {}
    if isinstance(exc, ModelNotFoundError):
        return 404, ErrorDetail(str(exc), "invalid_request_error", "model", "model_not_found"), {}
    if isinstance(exc, OverloadedError):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return 503, ErrorDetail(str(exc), "overloaded_error", None, "overloaded"), {"retry-after": retry}
    if isinstance(exc, DeployRefusedError):  # the version cannot be loaded here; nothing changed
        return 422, ErrorDetail(str(exc), "invalid_request_error", None, exc.reason.value), {}
    if isinstance(exc, EngineDeadError):
        return (
            503,
            ErrorDetail(str(exc) or "The engine is not running", "engine_dead_error", None, "engine_dead"),
            {},
        )
    log.error("unmapped driver error", extra={"request_id": request_id}, exc_info=exc)
    return 500, ErrorDetail("Internal server error", "server_error"), {}


def invalid_body(exc: msgspec.DecodeError) -> InvalidRequestError:
    """A malformed or ill-typed JSON body as a 400 naming the field msgspec complained about."""
    message = str(exc)
    path, missing = _FIELD_PATH.search(message), _MISSING_FIELD.search(message)
    param = ".".join(m.group(1) for m in (path, missing) if m and m.group(1)) or None
    if isinstance(exc, msgspec.ValidationError):
        return InvalidRequestError(f"Invalid request body: {message}", param)
    return InvalidRequestError(f"Malformed JSON body: {message}", param)


def _on_driver_error(request: Request, exc: DriverError) -> Response[bytes]:
    status, detail, headers = error_from_driver(exc, request_id_of(request))
    return error_response(
        status, detail.message, detail.type, detail.param, detail.code, headers, request_id_of(request)
    )


def error_from_tenant(exc: TenantError) -> tuple[int, ErrorDetail, dict[str, str]]:
    """Status, body and headers for a tenant-layer error (auth, limits, admin API)."""
    message = str(exc)
    if isinstance(exc, AuthenticationError):
        return 401, ErrorDetail(message, "authentication_error", None, "invalid_api_key"), {}
    if isinstance(exc, PermissionDeniedError):
        return 403, ErrorDetail(message, "permission_error", None, "permission_denied"), {}
    if isinstance(exc, NotFoundError):
        return 404, ErrorDetail(message, "not_found_error", None, "not_found"), {}
    if isinstance(exc, InvalidInputError):
        return 400, ErrorDetail(message, "invalid_request_error", exc.param), {}
    if isinstance(exc, ConflictError):
        return 409, ErrorDetail(message, "invalid_request_error", None, "conflict"), {}
    if isinstance(exc, QuotaExceededError):  # OpenAI's answer to a spent budget
        return 429, ErrorDetail(message, "insufficient_quota", None, "insufficient_quota"), {}
    if isinstance(exc, RateLimitedError):
        return 429, ErrorDetail(message, "rate_limit_error", None, "rate_limit_exceeded"), exc.headers
    if isinstance(exc, LimiterUnavailableError):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        detail = ErrorDetail(message, "service_unavailable_error", None, "ratelimit_unavailable")
        return 503, detail, {"retry-after": retry}
    log.error("unmapped tenant error", exc_info=exc)
    return 500, ErrorDetail("Internal server error", "server_error"), {}


def _on_tenant_error(request: Request, exc: TenantError) -> Response[bytes]:
    status, detail, headers = error_from_tenant(exc)
    return error_response(
        status, detail.message, detail.type, detail.param, detail.code, headers, request_id_of(request)
    )


def error_from_registry(exc: RegistryError) -> tuple[int, ErrorDetail]:
    """Status and body for a model registry error (versions/errors.py)."""
    message = str(exc)
    if isinstance(exc, UnknownModelError):
        return 404, ErrorDetail(message, "not_found_error", "model", "model_not_found")
    if isinstance(exc, InvalidRegistryInputError):
        return 400, ErrorDetail(message, "invalid_request_error", exc.param)
    if isinstance(exc, RegistryConflictError):
        return 409, ErrorDetail(message, "conflict_error", None, "conflict")
    if isinstance(exc, NoHostError):
        return 400, ErrorDetail(message, "invalid_request_error", None, "no_version_host")
    log.error("unmapped registry error", exc_info=exc)
    return 500, ErrorDetail("Internal server error", "server_error")


def _on_registry_error(request: Request, exc: RegistryError) -> Response[bytes]:
    status, detail = error_from_registry(exc)
    return error_response(status, detail.message, detail.type, detail.param, detail.code, {}, request_id_of(request))


def _on_http_error(request: Request, exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    message = exc.detail or "HTTP error"
    param = None
    if isinstance(exc, ValidationException) and exc.extra:
        message = f"{message}: {exc.extra}"
        first = exc.extra[0] if isinstance(exc.extra, list) and exc.extra else None
        param = first.get("key") if isinstance(first, dict) else None
    if status == 404 and message == "Not Found":
        message = f"Route {request.method} {request.url.path} not found"
    elif status == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        message = f"Request body is larger than the maximum of {limit} bytes"
    headers = {k: v for k, v in (exc.headers or {}).items()}
    return error_response(
        status,
        message,
        _HTTP_TYPES.get(status, "http_error"),
        param=param,
        code=status,
        headers=headers,
        request_id=request_id_of(request),
    )


def _on_timeout(request: Request, exc: LifetimeExceededError) -> Response[bytes]:
    return error_response(
        504, str(exc), "timeout_error", code="request_timeout", request_id=request_id_of(request)
    )


def _on_body_timeout(request: Request, exc: BodyTimeoutError) -> Response[bytes]:
    # The rest of the body may still arrive: the connection cannot carry another request.
    return error_response(
        408, str(exc), "timeout_error", code="body_timeout", headers={"connection": "close"},
        request_id=request_id_of(request),
    )


def _on_recursion(request: Request, exc: RecursionError) -> Response[bytes]:
    # msgspec gives up on JSON nested deeper than the interpreter's recursion limit, even in a field
    # nobody reads, with "maximum recursion depth exceeded while deserializing ..."; whether our
    # handler or Litestar (the admin API's bodies) decoded it, the body is at fault.
    if "deserializ" in str(exc):
        return error_response(
            400, "The JSON body is nested too deeply", "invalid_request_error", request_id=request_id_of(request)
        )
    return _on_unexpected(request, exc)


def _on_unexpected(request: Request, exc: Exception) -> Response[bytes]:
    rid = request_id_of(request)
    log.exception("unhandled error", extra={"request_id": rid, "path": request.url.path}, exc_info=exc)
    return error_response(500, "Internal server error", "server_error", request_id=rid)


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    DriverError: _on_driver_error,
    TenantError: _on_tenant_error,
    RegistryError: _on_registry_error,
    HTTPException: _on_http_error,
    LifetimeExceededError: _on_timeout,
    BodyTimeoutError: _on_body_timeout,
    RecursionError: _on_recursion,
    Exception: _on_unexpected,
}
