"""The names of full KV blocks in the prefix cache: a SHA-256 chain over tenant salt and token ids.

    root      = SHA-256(b"sluice-prefix-v1\\0" + salt)             salt: the tenant id (UTF-8) or empty
    block i   = SHA-256(name of block i-1 + token ids of block i as little-endian uint32)

A hit reuses another request's KV without comparing tokens, so the name must not collide: Python's
`hash()` (64 bits, not collision-resistant, and salted per process for strings) could make two
different prompts share KV silently, as vLLM found (CVE-2025-25183) before it moved to SHA-256.
The chain is also the same in every process, so a router can compute the names a worker uses.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_DOMAIN = b"sluice-prefix-v1\0"


def root_hash(salt: str | None) -> BlockHash:
    return hashlib.sha256(_DOMAIN + (salt or "").encode("utf-8")).digest()


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[BlockHash]:
    """Names of every full block of `token_ids`, in order."""
    names: list[BlockHash] = []
    parent = root_hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        names.append(parent)
    return names
