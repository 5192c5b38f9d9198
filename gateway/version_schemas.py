"""Wire format of the model registry's admin API (`/admin/registry/...`): bodies and replies."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from drivers.hosting import HostedVersion
from observability.version_view import VersionFigures
from versions.repository import AliasRecord, ChangeRecord, VersionRecord
from versions.routing import AppliedAlias

VersionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Source = Annotated[str, Meta(min_length=1, max_length=1000, description="a .gguf file or a Hugging Face folder")]
Dtype = Literal["auto", "float32", "bfloat16"]
Generation = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Percent = Annotated[int, Meta(ge=0, le=100)]


class VersionCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    version: VersionName
    source: Source
    dtype: Dtype = "auto"


class AliasUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    weights: Annotated[dict[VersionName, Percent], Meta(min_length=1, max_length=16,
                                                        description="version -> percent; they sum to 100")]
    generation: Annotated[Generation, Meta(description="the generation this change replaces (0: none yet)")]


class Rollback(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    generation: Generation | None = None  # the generation the caller saw; None: whatever is newest


class VersionOut(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    version: str
    id: str  # what `model` says in responses, and what addresses it directly
    source: str
    dtype: str
    state: str
    fingerprint: str
    detail: str | None
    created_at: dt.datetime
    created_by: str
    updated_at: dt.datetime
    updated_by: str
    hosted_here: bool  # this replica serves it now
    in_flight: int  # requests running on it on this replica

    @classmethod
    def of(cls, r: VersionRecord, hosted: dict[str, HostedVersion]) -> VersionOut:
        h = hosted.get(r.id)
        return cls(model=r.model, version=r.version, id=r.id, source=r.source, dtype=r.dtype, state=r.state.value,
                   fingerprint=r.fingerprint, detail=r.detail, created_at=r.created_at, created_by=r.created_by,
                   updated_at=r.updated_at, updated_by=r.updated_by, hosted_here=h is not None and not h.draining,
                   in_flight=h.in_flight if h is not None else 0)


class AliasOut(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    generation: int
    weights: dict[str, int]
    created_at: dt.datetime
    created_by: str

    @classmethod
    def of(cls, a: AliasRecord) -> AliasOut:
        return cls(model=a.model, generation=a.generation, weights=a.weights, created_at=a.created_at,
                   created_by=a.created_by)


class AppliedOut(msgspec.Struct, frozen=True, kw_only=True):
    """What this replica routes by now, and since when (time.time())."""

    generation: int
    weights: dict[str, int]
    applied_at: float

    @classmethod
    def of(cls, a: AppliedAlias) -> AppliedOut:
        return cls(generation=a.alias.generation, weights=a.alias.weights, applied_at=a.applied_at)


class ModelOut(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    alias: AliasOut | None  # in the database
    applied: AppliedOut | None  # on this replica
    versions: list[VersionOut]


class ModelsOut(msgspec.Struct, frozen=True):
    data: list[ModelOut]


class ChangeOut(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    version: str | None
    action: str
    detail: str
    actor: str
    created_at: dt.datetime

    @classmethod
    def of(cls, c: ChangeRecord) -> ChangeOut:
        return cls(model=c.model, version=c.version, action=c.action, detail=c.detail, actor=c.actor,
                   created_at=c.created_at)


class ChangesOut(msgspec.Struct, frozen=True):
    data: list[ChangeOut]


class VersionMetricsOut(msgspec.Struct, frozen=True, kw_only=True):
    """Per-version figures on this replica (observability/version_view.py)."""

    model: str
    versions: list[VersionFigures]


class TenantModels(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A tenant's model list: public name -> pinned version, or null for whatever the alias says.
    `models: null` lifts every restriction."""

    models: Annotated[dict[Annotated[str, Meta(min_length=1, max_length=100)], VersionName | None], Meta(
        max_length=100)] | None
