"""Async client of one engine process: spawn it, add and abort requests, stream outputs back.

A reader thread blocks on the engine's pipe and hands each message to the
event loop; a writer thread sends, so a busy engine never blocks the loop.
Each request gets an asyncio.Queue of `RequestOutput | EngineError`: a request
that ends without output ends with one of the typed errors of `errors.py`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time

import msgspec

from engine_native.config import EngineConfig
from engine_native.errors import EngineDeadError, EngineError, InvalidRequestError, QueueFullError
from engine_native.messages import (
    AbortRequest,
    AddRejected,
    AddRequest,
    ClientMessage,
    EngineFailed,
    EngineMessage,
    EngineReady,
    EngineStats,
    RejectReason,
    RequestOutput,
    SetFault,
    Shutdown,
    StepOutputs,
)
from engine_native.process import engine_main

log = logging.getLogger(__name__)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self._progress = progress
        self._streams: dict[str, asyncio.Queue[RequestOutput | EngineError]] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[EngineReady] | None = None
        self._proc: mp.process.BaseProcess | None = None
        self.info: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self._stats_waiters: list[asyncio.Future[EngineStats]] = []
        self.fault: tuple[float, bool] = (0.0, False)  # (step_delay_s, stall) last sent
        self.last_output_at = 0.0  # time.time() of the latest StepOutputs: the watchdog's evidence

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self, timeout_s: float = 300.0) -> EngineReady:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        ctx = mp.get_context("spawn")
        parent_in, child_out = ctx.Pipe(duplex=False)  # engine -> client
        child_in, parent_out = ctx.Pipe(duplex=False)  # client -> engine
        self._proc = ctx.Process(
            target=engine_main,
            args=(self.config, child_in, child_out, self._progress),
            name=f"sluice-engine-{self.config.node_id}",
            daemon=True,
        )
        self._proc.start()
        child_in.close()
        child_out.close()
        threading.Thread(target=self._read_loop, args=(parent_in,), daemon=True).start()
        threading.Thread(target=self._write_loop, args=(parent_out,), daemon=True).start()
        self.info = await asyncio.wait_for(self._ready, timeout_s)
        return self.info

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._send(Shutdown())
        self._outbox.put(None)
        if self._proc is not None:
            proc = self._proc
            await asyncio.to_thread(proc.join, timeout_s)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self._fail_all("engine shut down")

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ----- requests --------------------------------------------------------------------

    def add(self, msg: AddRequest) -> asyncio.Queue[RequestOutput | EngineError]:
        """Send a request; its outputs, or the error it ended with, arrive on the returned queue.
        Raises EngineDeadError when the engine is not running."""
        if not self.alive:
            raise EngineDeadError(f"engine {self.config.node_id} is not running: {self.dead_reason}")
        stream: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        self._streams[msg.request_id] = stream
        self._send(msg)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
        if request_ids and self.alive:
            self._send(AbortRequest(request_ids))

    def set_fault(self, step_delay_s: float = 0.0, stall: bool = False) -> None:
        """Chaos testing: make this engine slow (a sleep after each step) or stalled; zeros clear it."""
        self._send(SetFault(step_delay_s=step_delay_s, stall=stall))
        self.fault = (step_delay_s, stall)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def wait_for_stats(self, after: float, timeout_s: float = 5.0) -> EngineStats:
        """The first stats the engine produces with a timestamp later than `after` (time.time())."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stats is not None and self.stats.timestamp > after:
                return self.stats
            await asyncio.sleep(0.02)
        raise TimeoutError("the engine sent no fresh stats")

    # ----- threads ---------------------------------------------------------------------

    def _send(self, msg: ClientMessage) -> None:
        self._outbox.put(msgspec.msgpack.encode(msg))

    def _write_loop(self, conn) -> None:  # type: ignore[no-untyped-def]
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                conn.send_bytes(data)
            except OSError:
                return

    def _read_loop(self, conn) -> None:  # type: ignore[no-untyped-def]
        decoder = msgspec.msgpack.Decoder(EngineMessage)
        assert self._loop is not None
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._on_dead, "the engine process exited")
                return
            self._loop.call_soon_threadsafe(self._dispatch, decoder.decode(data))

    # ----- on the event loop -----------------------------------------------------------

    def _dispatch(self, msg: EngineMessage) -> None:
        if isinstance(msg, StepOutputs):
            self.last_output_at = time.time()
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
                    if out.finish_reason is not None:
                        del self._streams[out.request_id]
        elif isinstance(msg, EngineStats):
            self.stats = msg
            # The engine sends stats right after EngineReady: start() returns once both are in.
            if self.info is not None and self._ready is not None and not self._ready.done():
                self._ready.set_result(self.info)
        elif isinstance(msg, AddRejected):
            stream = self._streams.pop(msg.request_id, None)
            if stream is not None:
                error = QueueFullError if msg.reason is RejectReason.QUEUE_FULL else InvalidRequestError
                stream.put_nowait(error(msg.message))
        elif isinstance(msg, EngineReady):
            self.info = msg
        elif isinstance(msg, EngineFailed):
            self._on_dead(msg.error)

    def _on_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            log.error("engine %s died: %s", self.config.node_id, reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"engine failed to start: {reason}"))
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_nowait(EngineDeadError(reason))
