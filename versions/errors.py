"""Errors of the model registry; `gateway.errors` maps each to an HTTP status, nowhere else."""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry error."""


class UnknownModelError(RegistryError):
    """No such public model or version in the registry (404)."""


class UnknownTenantError(UnknownModelError):
    """No such tenant, for a tenant's model access (404)."""


class InvalidRegistryInputError(RegistryError):
    """A name, weight or source the registry cannot take (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RegistryConflictError(RegistryError):
    """The change collides with the registry's state (409): a stale alias generation, a version that
    exists already, one that is not ready, or one an alias still points at."""


class NoHostError(RegistryError):
    """This server's driver cannot host model versions (the synthetic driver) (400)."""
