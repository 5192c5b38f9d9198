"""The routing table a replica builds from registry snapshots (hand-made, as the repository returns them):
weights split exactly, a request stays pinned to the generation it resolved against, a generation is
applied only once its versions are hosted here, version ids are addressed but never listed."""

from __future__ import annotations

import datetime as dt
from collections import Counter

import pytest

from drivers.base import ModelCard, ModelNotFoundError
from drivers.hosting import HostedVersion
from versions.names import VersionState
from versions.repository import AliasRecord, RegistrySnapshot, VersionRecord
from versions.routing import ModelRouter

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def version(name: str, state: VersionState = VersionState.READY) -> VersionRecord:
    model, _, v = name.partition("@")
    return VersionRecord(model, v, f"/m/{v}", "auto", state, f"fp_{v}", None, NOW, "a", NOW, "a")


def snapshot(generation: int, weights: dict[str, int], *versions: VersionRecord) -> RegistrySnapshot:
    return RegistrySnapshot(("chat",), {v.id: v for v in versions},
                            {"chat": AliasRecord("chat", generation, weights, NOW, "a")})


def hosted(*ids: str) -> dict[str, HostedVersion]:
    return {i: HostedVersion(i, None, 0, False) for i in ids}


def test_weights_split_exactly_and_interleaved() -> None:
    router = ModelRouter()
    router.apply(snapshot(3, {"v1": 90, "v2": 10}, version("chat@v1"), version("chat@v2")), hosted("chat@v1", "chat@v2"))
    picks = [router.resolve("chat") for _ in range(400)]
    assert Counter(p.model_id for p in picks) == {"chat@v1": 360, "chat@v2": 40}
    assert all(p.generation == 3 and p.public_name == "chat" for p in picks)
    runs = [picks[i].model_id for i in range(100)]
    assert max(len(r) for r in "".join("b" if m == "chat@v2" else "a" for m in runs).split("b")) <= 9
    assert {p.fingerprint for p in picks} == {"fp_v1", "fp_v2"}
    assert router.leases == {"chat@v1": 360, "chat@v2": 40}
    for p in picks:
        router.release(p)
    assert not router.leases


def test_a_generation_waits_for_its_versions_and_requests_stay_pinned() -> None:
    router = ModelRouter()
    v1, v2 = version("chat@v1"), version("chat@v2")
    router.apply(snapshot(1, {"v1": 100}, v1, v2), hosted("chat@v1"))
    pinned = router.resolve("chat")
    # Generation 2 names v2, which this replica does not host yet: it keeps routing by generation 1.
    table = router.apply(snapshot(2, {"v2": 100}, v1, v2), hosted("chat@v1"))
    assert table.pending == {"chat": 2} and table.aliases["chat"].alias.generation == 1
    assert router.resolve("chat").model_id == "chat@v1"
    router.apply(snapshot(2, {"v2": 100}, v1, v2), hosted("chat@v1", "chat@v2"))
    after = router.resolve("chat")
    assert (after.model_id, after.generation) == ("chat@v2", 2)
    assert (pinned.model_id, pinned.generation) == ("chat@v1", 1)  # resolved once, never again
    assert router.leases["chat@v1"] == 2


def test_versions_are_addressed_directly_only_while_ready_and_never_listed() -> None:
    router = ModelRouter()
    router.apply(snapshot(1, {"v1": 100}, version("chat@v1"), version("chat@v0", VersionState.DRAINING)),
                 hosted("chat@v1", "chat@v0"))
    assert router.resolve("chat@v1").generation is None  # addressed, not chosen by the alias
    with pytest.raises(ModelNotFoundError):
        router.resolve("chat@v0")  # draining: no new request
    with pytest.raises(ModelNotFoundError):
        router.resolve("chat@v7")
    other = router.resolve("bundled")  # outside the registry: passed to the driver as it is
    assert (other.model_id, other.fingerprint) == ("bundled", None)
    cards = [ModelCard("chat@v1", 256), ModelCard("chat@v0", 256), ModelCard("bundled", 512), ModelCard("x@y", 64)]
    assert [c.id for c in router.public_cards(cards)] == ["chat", "bundled", "x@y"]
    assert router.resolve(None).public_name == "chat"  # no model named: the first alias


def test_a_tenant_model_list_limits_and_pins() -> None:
    router = ModelRouter()
    snap = snapshot(2, {"v2": 100}, version("chat@v1"), version("chat@v2"))
    snap = RegistrySnapshot(("chat", "code"), snap.versions, snap.aliases, {"pinned": {"chat": "v1"}, "none": {}})
    router.apply(snap, hosted("chat@v1", "chat@v2"))
    assert router.resolve("chat", "free").model_id == "chat@v2"  # no list: the alias
    pinned = router.resolve("chat", "pinned")
    assert (pinned.model_id, pinned.generation, pinned.fingerprint) == ("chat@v1", None, "fp_v1")
    assert router.resolve(None, "pinned").model_id == "chat@v1"
    for name in ("chat@v2", "code", "bundled"):
        with pytest.raises(ModelNotFoundError):
            router.resolve(name, "pinned")
    with pytest.raises(ModelNotFoundError):
        router.resolve("chat", "none")  # an empty list: no model at all
    cards = [ModelCard("chat@v2", 256), ModelCard("bundled", 512)]
    assert [c.id for c in router.public_cards(cards, "pinned")] == ["chat"]
    assert [c.id for c in router.public_cards(cards, "free")] == ["chat", "bundled"]
