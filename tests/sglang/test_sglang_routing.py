"""The routing structures without servers: the approximate tree (match, LRU eviction that never cuts
a path, its integrity check), the KV event index (stored, removed, cleared, chained pages), the
router's three rules on hand-made nodes, and the load read from /get_load or /metrics."""

from __future__ import annotations

import msgspec
import pytest

from drivers.sglang.client import ServerLoad, parse_load, parse_metrics
from drivers.sglang.config import CacheRoutingConfig
from drivers.sglang.kv_events import BlockIndex
from drivers.sglang.prefix_tree import PrefixTree
from drivers.sglang.router import CacheAwareRouter, Pick, ServerNode
from observability.node_health import NodeHealthConfig, NodeHealthMonitor


def test_prefix_tree_matches_whole_pages_and_evicts_least_recent_leaves() -> None:
    tree = PrefixTree(page_size=4, max_pages=6)
    system = list(range(100, 108))  # two pages
    tree.insert(system + [1, 2, 3, 4])
    tree.insert(system + [5, 6, 7, 8, 9])
    tree.check_integrity()
    assert tree.match(system + [1, 2, 3, 4, 0]) == 12
    assert tree.match(system + [5, 6, 7]) == 8  # a partial page does not count
    assert tree.pages == 4
    for i in range(3):
        tree.insert(system + [20 + i] * 4)
        tree.check_integrity()
    assert tree.pages == 6
    assert tree.match(system) == 8  # the shared pages outlive the leaves that used them
    assert tree.match(system + [1, 2, 3, 4]) == 8  # the oldest leaf went first
    copy = PrefixTree(page_size=4, max_pages=6)  # the snapshot: paths in LRU order rebuild the same tree
    for path in tree.paths():
        copy.insert(path)
    copy.check_integrity()
    assert copy.paths() == tree.paths()


def _batch(*events: list[object]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events)])


def test_block_index_follows_stored_removed_and_cleared() -> None:
    index = BlockIndex()
    index.apply_batch(_batch(["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None]))
    index.apply_batch(_batch(["BlockStored", [13], 12, [9, 9, 9, 9], 4, None]))
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0]) == 12
    assert index.match([5, 6, 7, 8]) == 0  # the same page under another parent is not cached
    index.apply_batch(_batch(["BlockRemoved", [13]]))
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]) == 8
    index.apply_batch(_batch(["AllBlocksCleared"]))
    assert index.match([1, 2, 3, 4]) == 0 and not index.blocks


def _router(**routing: float) -> CacheAwareRouter:
    return CacheAwareRouter(CacheRoutingConfig(page_size=4, min_match_tokens=8, **routing),  # type: ignore[arg-type]
                            NodeHealthMonitor([], NodeHealthConfig()))


def test_router_prefers_cache_spills_on_imbalance_and_spreads_misses() -> None:
    router = _router(balance_abs=2, balance_rel=1.5)
    a, b = ServerNode("a", "http://a", model="m", up=True), ServerNode("b", "http://b", model="m", up=True)
    prompt = list(range(16))
    router.routed("b", prompt)
    assert router.pick([a, b], prompt + [99]) == (b, Pick.CACHE)
    b.running = 3  # 3 vs 0: beyond the guard
    assert router.pick([a, b], prompt) == (a, Pick.BALANCE)
    b.running = 0
    misses = {router.pick([a, b], [500 + i] * 16)[0].id for i in range(4)}
    assert misses == {"a", "b"}


def test_metrics_text_gives_load_summed_over_ranks_and_the_fullest_kv() -> None:
    lines = [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{model_name="m",dp_rank="0"} 3.0',
        'sglang:num_running_reqs{model_name="m",dp_rank="1"} 2.0',
        'sglang:num_queue_reqs{model_name="m",dp_rank="0"} 7.0',
        'sglang:num_queue_reqs{model_name="m",dp_rank="1"} NaN',
        'sglang:token_usage{model_name="m",dp_rank="0"} 0.25',
        'sglang:token_usage{model_name="m",dp_rank="1"} 0.5',
        'sglang:num_running_reqs_total{model_name="m"} 99',  # another metric whose name starts alike
        'sglang:gen_throughput{model_name="m"} 120.5',
        "sglang:num_running_reqs garbage",
    ]
    assert parse_metrics("\n".join(lines)) == ServerLoad(5, 7, 0.5)
    assert parse_metrics("sglang:num_queue_reqs 4\n") == ServerLoad(0, 4, None)
    with pytest.raises(ValueError):
        parse_metrics('vllm:num_requests_running{model_name="m"} 3\n')  # not SGLang's: says nothing
    assert parse_load([{"num_reqs": 2, "num_waiting_reqs": 1}, {"num_reqs": 1}]) == ServerLoad(3, 1)
