"""What a model name means on this replica now, and which requests still hold each version.

A `RoutingTable` is immutable; `ModelRouter.apply` swaps in a new one whenever the registry changes
(versions/sync.py). A request resolves its model once, at admission, against the table of that
moment (`ModelRouter.resolve`): it is pinned to that alias generation and version for its whole life,
however many generations come after, and holds a lease on the version until it ends, so that the
version is not unloaded under it.

    requested "chat"      the alias of generation g: {v1: 90, v2: 10} -> "chat@v1" or "chat@v2", split
                          by smooth weighted round robin (over any 100 requests exactly 90 / 10)
    requested "chat@v2"   that version, if it is ready and hosted here
    anything else         passed through unchanged: a model the driver serves outside the registry

A replica applies a generation only once it hosts every version the generation names; until then
it keeps routing by the previous one (docs/versions.md).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from drivers.base import ModelCard, ModelNotFoundError
from drivers.hosting import HostedVersion
from versions.names import VersionState, split_version_id, version_id
from versions.repository import AliasRecord, RegistrySnapshot, VersionRecord

log = logging.getLogger("sluice.versions")


@dataclass(frozen=True)
class Target:
    """What one request was resolved to, at admission."""

    model_id: str | None  # what the driver is asked for: a version id, or a name outside the registry (None: its first)
    public_name: str | None  # the name the client used (None: it named none)
    generation: int | None  # the alias generation that chose the version; None: not through an alias
    fingerprint: str | None  # the version's system_fingerprint; None outside the registry


@dataclass
class _Picker:
    """Smooth weighted round robin (nginx's): over any window of sum(weights) picks each version
    gets exactly its weight, interleaved rather than in runs."""

    weights: dict[str, int]
    current: dict[str, int] = field(default_factory=dict)

    def pick(self) -> str:
        total = sum(self.weights.values())
        for version, weight in self.weights.items():
            self.current[version] = self.current.get(version, 0) + weight
        chosen = max(self.weights, key=lambda v: (self.current[v], v))
        self.current[chosen] -= total
        return chosen


@dataclass
class AppliedAlias:
    alias: AliasRecord
    applied_at: float  # time.time() this replica started routing by it
    picker: _Picker


@dataclass(frozen=True)
class RoutingTable:
    models: frozenset[str] = frozenset()  # every registered public name
    versions: Mapping[str, VersionRecord] = field(default_factory=dict)  # ready and hosted here, by id
    aliases: Mapping[str, AppliedAlias] = field(default_factory=dict)
    pending: Mapping[str, int] = field(default_factory=dict)  # model -> newest generation not applied yet
    # tenant id -> {model: pinned version or None}; a tenant absent here may use every model
    access: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)


class ModelRouter:
    def __init__(self) -> None:
        self.table = RoutingTable()
        self.leases: Counter[str] = Counter()  # version id -> requests resolved to it and not ended

    # ----- applying the registry ------------------------------------------------------------

    def apply(self, snapshot: RegistrySnapshot, hosted: Mapping[str, HostedVersion]) -> RoutingTable:
        old = self.table
        versions = {
            vid: rec for vid, rec in snapshot.versions.items()
            if rec.state == VersionState.READY and vid in hosted and not hosted[vid].draining
        }
        aliases: dict[str, AppliedAlias] = {}
        pending: dict[str, int] = {}
        for model, alias in snapshot.aliases.items():
            previous = old.aliases.get(model)
            if previous is not None and previous.alias.generation == alias.generation:
                aliases[model] = previous
                continue
            if all(version_id(model, v) in versions for v in alias.weights):
                aliases[model] = AppliedAlias(alias, time.time(), _Picker(dict(alias.weights)))
                log.info("model alias applied", extra={"model": model, "generation": alias.generation,
                                                       "weights": alias.weights})
                continue
            pending[model] = alias.generation
            if previous is not None and all(version_id(model, v) in versions for v in previous.alias.weights):
                aliases[model] = previous  # keep serving the generation before until this one can be
        self.table = RoutingTable(frozenset(snapshot.models), versions, aliases, pending, snapshot.access)
        return self.table

    # ----- resolving requests ---------------------------------------------------------------

    def resolve(self, requested: str | None, tenant_id: str | None = None) -> Target:
        """Pin a request to a version (ModelNotFoundError: 404). Call `release` when it ends.

        A tenant with a model list may use only those models (anything else is a 404, as OpenAI
        answers a model you have no access to); a model pinned for it means that version only."""
        table = self.table
        access = table.access.get(tenant_id) if tenant_id is not None else None
        if requested is None:
            if access:
                requested = min(access)
            elif not table.aliases:
                return Target(None, None, None, None)  # the driver's first model, as without a registry
            else:
                requested = min(table.aliases)
        model, version = split_version_id(requested)
        if access is not None:
            if model not in access or (version is not None and access[model] not in (None, version)):
                raise ModelNotFoundError(requested)
            pinned = access[model]
            if pinned is not None:
                version, requested = pinned, version_id(model, pinned)
        if version is not None and model in table.models:
            record = table.versions.get(requested)
            if record is None:
                raise ModelNotFoundError(requested)
            return self._lease(Target(requested, model, None, record.fingerprint))
        applied = table.aliases.get(requested)
        if applied is not None:
            vid = version_id(requested, applied.picker.pick())
            return self._lease(Target(vid, requested, applied.alias.generation, table.versions[vid].fingerprint))
        return Target(requested, requested, None, None)

    def _lease(self, target: Target) -> Target:
        assert target.model_id is not None
        self.leases[target.model_id] += 1
        return target

    def release(self, target: Target) -> None:
        vid = target.model_id
        if target.fingerprint is None or vid is None:
            return  # outside the registry: nothing was leased
        self.leases[vid] -= 1
        if self.leases[vid] <= 0:
            del self.leases[vid]

    # ----- what clients see -----------------------------------------------------------------

    def public_cards(self, cards: list[ModelCard], tenant_id: str | None = None) -> list[ModelCard]:
        """`/v1/models`: every alias this replica routes by, and models served outside the registry;
        never a version id (those are addressed, not listed). A tenant with a model list sees those."""
        table = self.table
        access = table.access.get(tenant_id) if tenant_id is not None else None
        if access is not None:
            return [c for c in self._public(cards) if c.id in access]
        return self._public(cards)

    def _public(self, cards: list[ModelCard]) -> list[ModelCard]:
        table = self.table
        by_id = {c.id: c for c in cards}
        listed: list[ModelCard] = []
        for model, applied in sorted(table.aliases.items()):
            card = next((by_id[version_id(model, v)] for v in applied.alias.weights if version_id(model, v) in by_id),
                        None)
            if card is not None:
                listed.append(msgspec.structs.replace(card, id=model))
        for card in cards:
            name, version = split_version_id(card.id)
            if version is None and card.id not in table.aliases:
                listed.append(card)
            elif version is not None and name not in table.models:
                listed.append(card)  # a name with "@" the registry does not know: an ordinary model
        return listed
