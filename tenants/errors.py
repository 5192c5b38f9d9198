"""Errors the tenant layer raises; `gateway.errors` maps each class to an HTTP status, nowhere else."""

from __future__ import annotations


class TenantError(Exception):
    """Base of every tenant-layer error."""


class AuthenticationError(TenantError):
    """No key, or an unknown, revoked or expired one (401)."""


class PermissionDeniedError(TenantError):
    """A valid caller that may not do this: suspended tenant, tenant key on the admin API (403)."""


class NotFoundError(TenantError):
    """No such tenant or key (404)."""


class InvalidInputError(TenantError):
    """A value the schema cannot express as invalid, e.g. start after end (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConflictError(TenantError):
    """The change collides with existing data, e.g. a duplicate tenant name (409)."""


class QuotaExceededError(TenantError):
    """The tenant's monthly token budget is spent (429, code insufficient_quota)."""


class RateLimitedError(TenantError):
    """A per-minute or concurrency limit refused the request (429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = headers


class LimiterUnavailableError(TenantError):
    """The shared rate-limit backend is down and the fail mode is closed (503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
