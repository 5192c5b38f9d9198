"""Wire format of the admin API and /v1/usage: request bodies (with their constraints) and replies.

Constraints live here as msgspec `Meta` so a bad body is a 400 naming the
field and the OpenAPI schema shows the ranges. Every range is one its column
holds on SQLite and PostgreSQL alike (the bounds are in tenants/bounds.py).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from tenants.bounds import (
    INT32_MAX,
    KEY_NAME_CHARS,
    NAME_PATTERN,
    SAFE_INT_MAX,
    TENANT_NAME_CHARS,
    WEIGHT_MAX,
    WEIGHT_MIN,
)
from tenants.latency import LatencyGroup, LatencyReport, Percentiles
from tenants.models import ApiKey, Tenant
from tenants.service import UsageReport

_NAME_DOC = "at least one visible character; no control characters"
TenantName = Annotated[
    str, Meta(min_length=1, max_length=TENANT_NAME_CHARS, pattern=NAME_PATTERN, description=_NAME_DOC)
]
KeyName = Annotated[
    str, Meta(min_length=1, max_length=KEY_NAME_CHARS, pattern=NAME_PATTERN, description=_NAME_DOC)
]
Priority = Annotated[int, Meta(ge=0, le=2, description="0 premium, 1 standard, 2 batch (lower runs first)")]
PerMinute = Annotated[int, Meta(ge=1, le=SAFE_INT_MAX)]
Concurrency = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Budget = Annotated[int, Meta(ge=1, le=SAFE_INT_MAX, description="tokens per calendar month (UTC)")]
Weight = Annotated[
    float,
    Meta(
        ge=WEIGHT_MIN,
        le=WEIGHT_MAX,
        description="fair-share weight relative to other tenants",
    ),
]
Status = Literal["active", "suspended"]
StripeCustomerId = Annotated[
    str,
    Meta(
        min_length=5,
        max_length=255,
        pattern=r"^cus_[A-Za-z0-9]+$",
        description="the tenant's Stripe customer (cus_...); its usage is billed to it (docs/billing.md)",
    ),
]
AwareDateTime = Annotated[
    dt.datetime, Meta(tz=True, description="with a timezone, e.g. 2030-01-01T00:00:00Z")
]


class TenantCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: TenantName
    priority: Priority = 1
    requests_per_minute: PerMinute | None = 60
    tokens_per_minute: PerMinute | None = 100_000
    max_concurrent: Concurrency | None = 8
    monthly_token_budget: Budget | None = None  # None: unlimited
    weight: Weight = 1.0
    stripe_customer_id: StripeCustomerId | None = None


class TenantUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Only the fields sent change; null sets a limit to unlimited."""

    name: TenantName | UnsetType = UNSET
    priority: Priority | UnsetType = UNSET
    requests_per_minute: PerMinute | None | UnsetType = UNSET
    tokens_per_minute: PerMinute | None | UnsetType = UNSET
    max_concurrent: Concurrency | None | UnsetType = UNSET
    monthly_token_budget: Budget | None | UnsetType = UNSET
    weight: Weight | UnsetType = UNSET
    status: Status | UnsetType = UNSET
    stripe_customer_id: StripeCustomerId | None | UnsetType = UNSET  # null unlinks

    def changes(self) -> dict[str, object]:
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not UNSET}


class TenantOut(msgspec.Struct, kw_only=True):
    id: str
    name: str
    priority: int
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    monthly_token_budget: int | None
    weight: float
    status: Status
    stripe_customer_id: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    object: Literal["tenant"] = "tenant"

    @classmethod
    def of(cls, t: Tenant) -> TenantOut:
        return cls(
            id=t.id,
            name=t.name,
            priority=t.priority,
            requests_per_minute=t.requests_per_minute,
            tokens_per_minute=t.tokens_per_minute,
            max_concurrent=t.max_concurrent,
            monthly_token_budget=t.monthly_token_budget,
            weight=t.weight,
            status="suspended" if t.status == "suspended" else "active",
            stripe_customer_id=t.stripe_customer_id,
            created_at=t.created_at,
            updated_at=t.updated_at,
        )


class TenantList(msgspec.Struct):
    data: list[TenantOut]
    object: Literal["list"] = "list"


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: KeyName
    expires_at: AwareDateTime | None = None


class KeyOut(msgspec.Struct, kw_only=True):
    """A key as listed: the display prefix only, never the secret."""

    id: str
    tenant_id: str
    name: str
    prefix: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    object: Literal["api_key"] = "api_key"

    @classmethod
    def of(cls, k: ApiKey) -> KeyOut:
        return cls(
            id=k.id,
            tenant_id=k.tenant_id,
            name=k.name,
            prefix=k.prefix,
            created_at=k.created_at,
            last_used_at=k.last_used_at,
            expires_at=k.expires_at,
            revoked_at=k.revoked_at,
        )


class KeyCreated(KeyOut, kw_only=True):
    key: str  # the secret: shown in this response only


class KeyList(msgspec.Struct):
    data: list[KeyOut]
    object: Literal["list"] = "list"


class UsageBucket(msgspec.Struct):
    group: str  # YYYY-MM-DD (UTC) or the model id
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageOut(msgspec.Struct, kw_only=True):
    tenant_id: str
    start: dt.datetime
    end: dt.datetime
    group_by: Literal["day", "model"]
    data: list[UsageBucket]
    total_tokens: int
    object: Literal["usage"] = "usage"

    @classmethod
    def of(cls, r: UsageReport) -> UsageOut:
        data = [
            UsageBucket(g.group, g.requests, g.prompt_tokens, g.completion_tokens, g.total_tokens)
            for g in r.groups
        ]
        return cls(
            tenant_id=r.tenant_id,
            start=r.start,
            end=r.end,
            group_by=r.group_by,
            data=data,
            total_tokens=sum(b.total_tokens for b in data),
        )


class PercentilesOut(msgspec.Struct):
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, p: Percentiles | None) -> PercentilesOut | None:
        return None if p is None else cls(p.p50, p.p90, p.p99)


class LatencyBucket(msgspec.Struct, kw_only=True):
    group: str  # YYYY-MM-DD (UTC), the model id, or "all"
    requests: int  # completed requests the percentiles are over
    ttft_ms: PercentilesOut | None  # null: no request in the group produced a first token
    latency_ms: PercentilesOut | None

    @classmethod
    def of(cls, g: LatencyGroup) -> LatencyBucket:
        return cls(
            group=g.group,
            requests=g.requests,
            ttft_ms=PercentilesOut.of(g.ttft_ms),
            latency_ms=PercentilesOut.of(g.latency_ms),
        )


class LatencyOut(msgspec.Struct, kw_only=True):
    """Nearest-rank percentiles of time to first token and end-to-end latency (ms), completed requests."""

    tenant_id: str
    start: dt.datetime
    end: dt.datetime
    group_by: Literal["day", "model"]
    data: list[LatencyBucket]
    overall: LatencyBucket
    truncated: bool  # true: over tenants.latency.MAX_SAMPLES requests in range, the newest are used
    object: Literal["latency"] = "latency"

    @classmethod
    def of(cls, r: LatencyReport) -> LatencyOut:
        return cls(
            tenant_id=r.tenant_id,
            start=r.start,
            end=r.end,
            group_by=r.group_by,
            data=[LatencyBucket.of(g) for g in r.groups],
            overall=LatencyBucket.of(r.overall),
            truncated=r.truncated,
        )
