"""Version ids, version states, and the rules names and alias weights follow.

A version's lifecycle (`VersionState`, ordered):

    registered -> loading -> ready -> draining -> retired
        ^  ^         |                   |
        |  +---------+  a deploy that fails goes back to registered (the reason is in the change log)
        +--------------------------------+  released (no alias references it any more): unloaded,
                                            it may be deployed again

Only `ready` versions may be named by an alias or addressed directly (`name@version`).
"""

from __future__ import annotations

import enum
import re

from versions.errors import InvalidRegistryInputError

SEPARATOR = "@"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WEIGHT_TOTAL = 100  # alias weights are percentages


class VersionState(enum.StrEnum):
    REGISTERED = "registered"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    RETIRED = "retired"


HOSTED_STATES = frozenset({VersionState.LOADING, VersionState.READY})  # every replica should host these


def version_id(model: str, version: str) -> str:
    return f"{model}{SEPARATOR}{version}"


def split_version_id(text: str) -> tuple[str, str | None]:
    """'chat@v2' -> ('chat', 'v2'); 'chat' -> ('chat', None)."""
    model, sep, version = text.rpartition(SEPARATOR)
    return (model, version) if sep else (text, None)


def check_model_name(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidRegistryInputError(
            "a model name is 1-100 characters of letters, digits and . _ : -, starting with a letter or digit",
            "name",
        )
    return name


def check_version_name(version: str) -> str:
    if not _VERSION.match(version):
        raise InvalidRegistryInputError(
            "a version is 1-64 characters of letters, digits and . _ -, starting with a letter or digit",
            "version",
        )
    return version


def check_weights(weights: dict[str, int]) -> dict[str, int]:
    """Integer percentages summing to 100; zero weights are dropped (a version at 0 gets nothing)."""
    for version, weight in weights.items():
        check_version_name(version)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= WEIGHT_TOTAL:
            raise InvalidRegistryInputError(f"the weight of {version!r} must be an integer 0-100", "weights")
    kept = {v: w for v, w in weights.items() if w > 0}
    if sum(kept.values()) != WEIGHT_TOTAL:
        raise InvalidRegistryInputError(f"alias weights must sum to {WEIGHT_TOTAL}, not {sum(kept.values())}",
                                        "weights")
    return dict(sorted(kept.items()))
