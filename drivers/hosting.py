"""The contract for hosting several model versions behind one driver.

A `VersionHost` loads a version (a model file or folder under its version id, e.g. `chat@v2`),
serves requests whose `GenerationRequest.model` is that id, and unloads it once nothing runs on it.
The local implementation is `drivers.versioned.VersionedDriver` (one engine set per version, each with
its own KV pool and prefix cache); a fleet of remote workers implements the same protocol. The model
registry (`versions/`) decides what is hosted; a host only does what it is told and refuses, with a
typed reason, what it cannot do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from drivers.base import DriverError


class DeployRefusal(enum.StrEnum):
    MISSING_SOURCE = "missing_source"  # nothing at the version's path
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
    OVER_BUDGET = "over_budget"  # the version would not fit the host's memory budget
    INVALID_SOURCE = "invalid_source"  # something is there, but not a model we can read
    LOAD_FAILED = "load_failed"  # the engine failed while loading or warming it


class DeployRefusedError(DriverError):
    """The host cannot load this version; nothing it serves has changed (HTTP 422)."""

    def __init__(self, reason: DeployRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class VersionSource:
    """What to load, and the id requests will name it by."""

    version_id: str  # "<model>@<version>"
    source: str  # a .gguf file or a Hugging Face folder
    dtype: str = "auto"


@dataclass(frozen=True)
class Footprint:
    """Memory a loaded version takes on a host (an estimate from the model's headers and the KV pool)."""

    architecture: str
    weight_bytes: int  # all of the host's copies of the weights (one per engine process)
    kv_bytes: int  # all of its KV pools

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class HostedVersion:
    version_id: str
    footprint: Footprint | None  # None: not estimated (a model the host started with and could not read)
    in_flight: int  # requests running on it now
    draining: bool  # being unloaded: takes no new request


@runtime_checkable
class VersionHost(Protocol):
    def hosted(self) -> dict[str, HostedVersion]:
        """Every version id this host serves now (loading ones excluded)."""
        ...

    async def check(self, source: VersionSource) -> Footprint:
        """Refuse (DeployRefusedError) what could not be loaded, without loading anything."""
        ...

    async def load(self, source: VersionSource) -> Footprint:
        """Load and warm `source`; returns once it serves. Idempotent for a version already hosted."""
        ...

    async def unload(self, version_id: str) -> None:
        """Take no new request for `version_id`, wait for the running ones, then free it. A no-op
        when it is not hosted."""
        ...
