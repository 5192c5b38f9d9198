"""Precise cache-aware routing: each SGLang server's KV blocks, as its KV events say.

A server started with `--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}'` publishes every change of its radix cache on a ZMQ PUB socket
as three frames (topic, sequence number: 8 bytes big-endian, msgpack payload). The payload is an
array-like batch [ts, events, ...], each event a tagged array:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]
    ["BlockRemoved", block_hashes, ...]
    ["AllBlocksCleared"]

A BlockStored covers len(block_hashes) consecutive pages of token_ids, the first one a child of
parent_block_hash (None, or a hash never stored: a child of the root). `BlockIndex` keeps, per
server, block hash -> (parent hash, page tokens) and (parent, page tokens) -> hash, so a prompt's
cached prefix is found by walking its pages from the root, and a removal (by hash) is exact.

A fresh gateway replica is not cache-blind: before reading live events it asks the replay
endpoint (a ROUTER socket) for every batch still buffered from sequence 0 (the server keeps the last
`buffer_steps`, 10,000 by default), applies them in order, then skips live batches it already has;
a gap in the sequence numbers (the PUB socket drops under its high-water mark) is replayed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

log = logging.getLogger("sluice.sglang")

Page = tuple[int, ...]
END_OF_REPLAY = -1
REPLAY_TIMEOUT_S = 2.0


class BlockIndex:
    """One server's cached blocks, from its events."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, Page]] = {}
        self.by_path: dict[tuple[int | None, Page], int] = {}
        self.block_size = 0
        self.last_seq = -1  # the newest batch applied

    def apply_batch(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        events = batch[1] if isinstance(batch, list) and len(batch) > 1 else []
        for event in events:
            if isinstance(event, list) and event:
                self.apply(event)

    def apply(self, event: list[Any]) -> None:
        tag = event[0]
        if tag == "BlockStored":
            hashes, parent, tokens, size = event[1], event[2], event[3], int(event[4])
            self.block_size = size
            if parent is not None and parent not in self.blocks:
                parent = None
            for i, block in enumerate(hashes):
                page = tuple(tokens[i * size: (i + 1) * size])
                self.blocks[block] = (parent, page)
                self.by_path[(parent, page)] = block
                parent = block
        elif tag == "BlockRemoved":
            for block in event[1]:
                entry = self.blocks.pop(block, None)
                if entry is not None and self.by_path.get(entry) == block:
                    del self.by_path[entry]
        elif tag == "AllBlocksCleared":
            self.blocks.clear()
            self.by_path.clear()

    def match(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` the server holds (whole blocks)."""
        size = self.block_size
        if size <= 0:
            return 0
        parent: int | None = None
        matched = 0
        for start in range(0, len(tokens) - size + 1, size):
            block = self.by_path.get((parent, tuple(tokens[start: start + size])))
            if block is None:
                break
            parent, matched = block, matched + size
        return matched


class KVEventSubscriber:
    """Keeps one server's `BlockIndex` current from its ZMQ publisher (and replay endpoint)."""

    def __init__(self, server_id: str, endpoint: str, replay_endpoint: str | None) -> None:
        self.server_id = server_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = BlockIndex()
        self.connected = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"sluice-kv-events-{self.server_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            await self._replay(ctx, 0)
            self.connected = True
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq <= self.index.last_seq:
                    continue  # already applied from the replay
                if seq > self.index.last_seq + 1 and self.index.last_seq >= 0:
                    await self._replay(ctx, self.index.last_seq + 1)  # a gap: fetch what was dropped
                    if seq <= self.index.last_seq:
                        continue
                self._apply(seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # a malformed batch must not take routing down: log and fall back
            log.exception("KV events of %s stopped; routing falls back to the approximate tree", self.server_id)
        finally:
            self.connected = False
            sub.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.index.apply_batch(payload)
        except (msgspec.DecodeError, TypeError, ValueError, IndexError) as exc:
            log.warning("undecodable KV event batch %d from %s: %s", seq, self.server_id, exc)
        self.index.last_seq = seq

    async def _replay(self, ctx: Any, start: int) -> None:
        if not self.replay_endpoint:
            return
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                except TimeoutError:
                    log.warning("replay from %s timed out at batch %d", self.server_id, self.index.last_seq)
                    return
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return
                if seq > self.index.last_seq:
                    self._apply(seq, frames[2])
        finally:
            dealer.close(linger=0)
