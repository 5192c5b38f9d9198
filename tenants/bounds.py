"""What the tenant columns hold, and fitting values to it before they reach the database.

One place for the ranges the admin API's schemas enforce (a value the schema accepts always
fits its column, on SQLite and PostgreSQL alike) and for the functions that make a usage record
storable whatever the client sent. Column lengths are read from the ORM models, so a migration
that widens a column widens the bound with it.

What breaks a write on some backend and is therefore never let through:

    text       NUL (PostgreSQL refuses it), unpaired surrogates (no UTF-8 encoding exists),
               more characters than the column's VARCHAR(n) (PostgreSQL refuses, SQLite keeps)
    integers   beyond the column's type: INTEGER is 32-bit on PostgreSQL
    floats     NaN (SQLite stores NULL, failing NOT NULL) and infinities
    datetimes  naive ones, and ones whose conversion to UTC leaves years 1..9999
"""

from __future__ import annotations

import datetime as dt
import math
import re

from sqlalchemy import Column, String

from tenants.models import ApiKey, Tenant, UsageRecord

INT32_MAX = 2**31 - 1
"""The largest value of an INTEGER column on PostgreSQL."""
SAFE_INT_MAX = 2**53 - 1
"""The largest integer a JSON number (an IEEE double) holds exactly: the bound of BIGINT fields, so
every client reads them back exactly and the Redis limiter's Lua numbers compare them exactly."""

WEIGHT_MIN = 0.001
WEIGHT_MAX = 1000.0
"""A fair-share weight is relative to the others: six orders of magnitude between two tenants
covers every real split while keeping any share computed from them far from under- and overflow."""

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def column_chars(column: Column[str]) -> int:
    """The VARCHAR length of a String column."""
    length = column.type.length if isinstance(column.type, String) else None
    assert length is not None, f"{column} has no length"
    return length


TENANT_NAME_CHARS = column_chars(Tenant.__table__.c.name)  # type: ignore[arg-type]
KEY_NAME_CHARS = column_chars(ApiKey.__table__.c.name)  # type: ignore[arg-type]
ID_CHARS = column_chars(Tenant.__table__.c.id)  # type: ignore[arg-type]

NAME_PATTERN = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$(?!\n)"
r"""A display name: at least one visible character and no control characters (tab and newline
included). The trailing `(?!\n)` keeps Python's `$` from matching before a final newline
(ECMAScript and Rust readers of the OpenAPI schema see a no-op there). Unpaired surrogates
are left out on purpose: JSON decoding already refuses them, and a surrogate range makes the
pattern unusable for schema validators that only know Unicode scalar values."""


def storable_text(value: str, max_chars: int) -> str:
    """`value` as every backend stores it: NUL and unpaired surrogates become U+FFFD, and it is cut
    to `max_chars` characters (the column's VARCHAR length)."""
    return _UNSTORABLE.sub("\ufffd", value[:max_chars])


def is_plain_text(value: str) -> bool:
    """True when `value` has no control character and no unpaired surrogate (what NAME_PATTERN allows
    besides the visible-character rule): safe to store and to echo in an error message."""
    return _CONTROL.search(value) is None


def could_be_id(value: str) -> bool:
    """Whether `value` could be the id of a stored tenant or key (ids are UUIDs): a value that cannot
    is answered "not found" without asking the database, which would refuse NUL on PostgreSQL."""
    return len(value) <= ID_CHARS and is_plain_text(value)


def clamp_int(value: int, high: int = INT32_MAX) -> int:
    return max(0, min(int(value), high))


def finite_or_none(value: float | None) -> float | None:
    """A non-negative finite float, or None for a missing or non-finite one."""
    if value is None or not math.isfinite(value):
        return None
    return max(0.0, float(value))


def utc(value: dt.datetime) -> dt.datetime:
    """`value` in UTC; a naive value is read as UTC. OverflowError when UTC leaves years 1..9999."""
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC)


USAGE_TEXT_CHARS = {
    name: column_chars(UsageRecord.__table__.c[name])  # type: ignore[arg-type]
    for name in ("request_id", "tenant_id", "key_id", "model", "status")
}
