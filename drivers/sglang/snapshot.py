"""The approximate routing trees on disk: saved every `snapshot_s` and at stop, loaded at start, so a
restarted gateway without KV events routes as before instead of starting cache-blind.

    {"page_size": 16, "trees": {"<server id>": [[token ids of one root-to-leaf path], ...]}}  (msgpack)

Paths are listed least recently used first, so inserting them in order rebuilds the same recency.
A file of another page size is ignored (its pages would match nothing); a damaged one is logged and
ignored: routing works without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import msgspec

from drivers.sglang.prefix_tree import PrefixTree

log = logging.getLogger("sluice.sglang")


def save_trees(path: str, trees: Mapping[str, PrefixTree], page_size: int) -> None:
    data = {"page_size": page_size, "trees": {sid: tree.paths() for sid, tree in trees.items()}}
    tmp = Path(path + ".tmp")
    try:
        tmp.write_bytes(msgspec.msgpack.encode(data))
        tmp.replace(path)  # atomic: a reader never sees half a file
    except OSError as exc:
        log.warning("cannot save the routing snapshot %s: %s", path, exc)


def load_trees(path: str, page_size: int) -> dict[str, list[list[int]]]:
    """Paths by server id; empty when there is no usable snapshot."""
    if not Path(path).exists():
        return {}
    try:
        data = msgspec.msgpack.decode(Path(path).read_bytes())
        if data.get("page_size") != page_size:
            return {}
        return {str(sid): [list(p) for p in paths] for sid, paths in data["trees"].items()}
    except (OSError, msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
        log.warning("cannot load the routing snapshot %s: %s", path, exc)
        return {}
