"""The router and the circuit breaker on hand-made membership views (no processes): the filter and
its reasons, the three policies, consistent hashing with bounded load, placement by the prefixes the
workers hold and the room in their KV pools, the workers' prefix ledger, and the breaker's states."""

from __future__ import annotations

import pytest

from drivers.base import ModelCard
from drivers.fleet.breaker import BreakerConfig, BreakerState, CircuitBreaker
from drivers.fleet.prefixes import PrefixLedger
from drivers.fleet.router import FleetRouter, HashRing, NoWorkerError, Policy, RouterConfig, prefix_key
from drivers.fleet.wire import HeldPrefix, WorkerInfo, WorkerLoad, WorkerState
from observability.node_health import NodeHealthMonitor

CARD = ModelCard(id="m", max_model_len=4096)


def worker(wid: str, state: WorkerState = WorkerState.READY, in_flight: int = 0, model: str = "m",
           kv_blocks: int = 0, prefixes: tuple[HeldPrefix, ...] = ()) -> WorkerInfo:
    return WorkerInfo(id=wid, address=f"http://{wid}", state=state, incarnation=1,
                      models=[ModelCard(id=model, max_model_len=4096)],
                      load=WorkerLoad(in_flight=in_flight, kv_blocks_total=kv_blocks), prefixes=list(prefixes))


def router(policy: Policy = Policy.PREFIX_AFFINITY, **kw: float) -> FleetRouter:
    return FleetRouter(RouterConfig(policy=policy, **kw), NodeHealthMonitor([]))  # type: ignore[arg-type]


def view(*workers: WorkerInfo) -> dict[str, WorkerInfo]:
    return {w.id: w for w in workers}


def prompt(tenant_seed: int, length: int = 100) -> list[int]:
    return [tenant_seed * 1000 + i for i in range(length)]


def test_filter_names_why_each_worker_is_out() -> None:
    r = router()
    r.breakers["d"] = CircuitBreaker(BreakerConfig())
    r.breakers["d"].failed(0.0, definite=True)
    r.monitor.add_node("d", 0.0)
    v = view(worker("a", WorkerState.DRAINING), worker("b", WorkerState.JOINING), worker("c", model="other"),
             worker("d"), worker("e"))
    with pytest.raises(NoWorkerError) as err:
        r.candidates(v, "m", now=1.0, exclude=["e"])
    message = str(err.value)
    for fragment in ["a: draining", "b: joining", "c: does not serve the model", "d: circuit open", "e: already tried"]:
        assert fragment in message
    assert [w.id for w in r.candidates(v, "m", now=1.0)] == ["e"]


def test_two_routers_place_a_prefix_on_the_same_worker() -> None:
    v = view(*(worker(f"w{i}") for i in range(4)))
    homes = set()
    for seed in range(20):
        picks = {router().pick(list(v.values()), prompt(seed), "tenant", v).id for _ in range(2)}
        assert len(picks) == 1  # independent routers, same view: same choice
        homes |= picks
    assert len(homes) > 1  # and the prefixes spread over the workers


def test_prefix_key_is_salted_per_tenant_and_ignores_the_tail() -> None:
    cfg = RouterConfig()
    base = prompt(1)
    assert prefix_key(base, "t1", cfg) == prefix_key(base[:64] + [7, 7, 7], "t1", cfg)
    assert prefix_key(base, "t1", cfg) != prefix_key(base, "t2", cfg)
    assert prefix_key(base[:15], "t1", cfg) is None  # shorter than a block: no affinity


def test_removing_a_worker_moves_only_its_own_prefixes() -> None:
    ring4 = HashRing([f"w{i}" for i in range(4)], 100)
    ring3 = HashRing([f"w{i}" for i in range(3)], 100)
    keys = [prefix_key(prompt(seed), None, RouterConfig()) for seed in range(200)]
    for key in keys:
        assert key is not None
        before, after = ring4.walk(key)[0], ring3.walk(key)[0]
        assert before == after or before == "w3"


def test_bounded_load_spills_a_hot_prefix() -> None:
    r = router(load_factor=1.25)
    v = view(*(worker(f"w{i}") for i in range(3)))
    home = r.pick(list(v.values()), prompt(9), None, v).id
    # The home worker holds far more than its share: the same prefix goes to the next one on the ring.
    loaded = {**v, home: worker(home, in_flight=10)}
    spill = r.pick(list(loaded.values()), prompt(9), None, loaded).id
    assert spill != home


def test_a_prefix_goes_to_the_worker_whose_heartbeat_lists_it() -> None:
    v = view(*(worker(f"w{i}") for i in range(4)))
    key = prefix_key(prompt(3), "t", RouterConfig())
    assert key is not None
    home = router().pick(list(v.values()), prompt(3), "t", v).id
    holder = next(wid for wid in sorted(v) if wid != home)  # it spilled there once, say
    held = {**v, holder: worker(holder, prefixes=(HeldPrefix(key, 7, 1.0),))}
    picks = {router().pick(list(held.values()), prompt(3), "t", held).id for _ in range(2)}
    assert picks == {holder}  # two routers, the same heartbeats: the same worker


def test_a_new_prefix_passes_a_home_whose_pool_is_full_of_recent_prefixes() -> None:
    big = prompt(5, length=1000)  # 63 blocks
    v = view(*(worker(f"w{i}", kv_blocks=182) for i in range(3)))
    home = router().pick(list(v.values()), big, None, v).id
    recent = (HeldPrefix(1, 64, 2.0), HeldPrefix(2, 64, 5.0))  # 128 of 182 blocks brought lately: 63 more do not fit
    full = {**v, home: worker(home, kv_blocks=182, prefixes=recent)}
    assert router().pick(list(full.values()), big, None, full).id != home
    stale = tuple(HeldPrefix(p.key, p.blocks, 600.0) for p in recent)  # not brought for 10 minutes
    cold = {**v, home: worker(home, kv_blocks=182, prefixes=stale)}
    assert router().pick(list(cold.values()), big, None, cold).id == home
    everyone_full = {wid: worker(wid, kv_blocks=182, prefixes=recent) for wid in v}
    assert router().pick(list(everyone_full.values()), big, None, everyone_full).id == home  # its LRU evicts


def test_prefixes_this_router_placed_count_until_heartbeats_list_them() -> None:
    # Four ~1,000-token system prompts over two workers whose pools hold two and a half of them: the
    # router spreads them two and two before any heartbeat lists one, then keeps each where it went.
    r = router()
    v = view(worker("w0", kv_blocks=182), worker("w1", kv_blocks=182))
    tenants = [1, 2, 5, 6]  # the ring alone puts all four on w0
    assert {r.home(v, prompt(t, length=1000), None) for t in tenants} == {"w0"}
    first = [r.pick(list(v.values()), prompt(t, length=1000), None, v).id for t in tenants]
    assert first == ["w0", "w0", "w1", "w1"]
    again = [r.pick(list(v.values()), prompt(t, length=1000), None, v).id for t in tenants]
    assert again == first


def test_the_ledger_keeps_what_the_pool_can_hold_most_recent_last() -> None:
    now = [0.0]
    ledger = PrefixLedger(keep=3, block_tokens=16, clock=lambda: now[0])
    for key in (1, 2, 3, 1):  # 1 again: the most recent
        now[0] += 1.0
        ledger.record(key, 160)  # 10 blocks each
    assert [(p.key, p.blocks, p.idle_s) for p in ledger.held(0)] == [(2, 10, 2.0), (3, 10, 1.0), (1, 10, 0.0)]
    assert [p.key for p in ledger.held(25)] == [3, 1]  # a 25-block pool holds two: 2 is evicted, and forgotten
    assert [p.key for p in ledger.held(0)] == [3, 1]
    for key in (4, 5, 6):
        ledger.record(key, 16)
    assert [p.key for p in ledger.held(0)] == [4, 5, 6]  # at most `keep`


def test_least_loaded_counts_what_this_router_sent() -> None:
    r = router(Policy.LEAST_LOADED)
    v = view(worker("a", in_flight=1), worker("b", in_flight=2))
    assert r.pick(list(v.values()), prompt(1), None, v).id == "a"
    r.in_flight["a"] = 5  # sent since the last heartbeat
    assert r.pick(list(v.values()), prompt(1), None, v).id == "b"


def test_round_robin_takes_turns() -> None:
    r = router(Policy.ROUND_ROBIN)
    v = view(worker("a"), worker("b"), worker("c"))
    picks = [r.pick(list(v.values()), prompt(1), None, v).id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_breaker_opens_probes_and_closes() -> None:
    b = CircuitBreaker(BreakerConfig(failures_to_open=2, open_s=5.0))
    b.failed(0.0)
    assert b.allows(0.0)
    b.failed(1.0)
    assert b.state is BreakerState.OPEN and not b.allows(5.9)
    assert b.allows(6.0) and b.state is BreakerState.HALF_OPEN
    b.picked()
    assert not b.allows(6.1)  # one probe at a time
    b.failed(6.2)
    assert b.state is BreakerState.OPEN and not b.allows(11.1)
    assert b.allows(11.2)
    b.picked()
    b.succeeded()
    assert b.state is BreakerState.CLOSED and b.allows(11.3)
