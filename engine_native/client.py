"""Async client of one engine process: spawn it, add and abort requests, stream outputs back.

A reader thread blocks on the engine's pipe and hands each message to the
event loop; a writer thread sends, so a busy engine never blocks the loop.
Each request gets an asyncio.Queue of `RequestOutput | EngineError`: a request
that ends without output ends with one of the typed errors of `errors.py`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from engine_native.config import EngineConfig
from engine_native.errors import (
    EngineDeadError,
    EngineError,
    EngineShutDownError,
    InvalidRequestError,
    QueueFullError,
)
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

DEATH_POLL_S = 1.0  # how often wait_dead() looks at the process itself


@dataclass(frozen=True)
class _Spawned:
    """A process spawn() started and start() has not yet taken: it and the parent's ends of its pipes."""

    proc: mp.process.BaseProcess
    inbox: Connection  # engine -> client
    outbox: Connection  # client -> engine


class AsyncEngineClient:
    """One engine node. Its process can be replaced (`restart`) while the client object, and so
    every reference to the node, stays; each process is an incarnation, and messages from an
    earlier one are ignored."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self._progress = progress
        self._streams: dict[str, asyncio.Queue[RequestOutput | EngineError]] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[EngineReady] | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._spawned: _Spawned | None = None  # spawn()ed, not yet start()ed
        self._incarnation = 0
        self._dead = asyncio.Event()
        self.info: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self.fault: tuple[float, bool] = (0.0, False)  # (step_delay_s, stall) last sent
        self.last_output_at = 0.0  # time.time() of the latest StepOutputs: the watchdog's evidence

    @property
    def node_id(self) -> str:
        return self.config.node_id

    # ----- lifecycle -------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the engine process now, without an event loop: it loads its model while the caller
        goes on (`sluice serve` spawns before the gateway's own imports); `start()` then waits for it.
        A process spawned and never started is killed at interpreter exit."""
        if self._spawned is not None or self.alive:
            return
        self._spawned = self._start_process()
        # multiprocessing's own exit handler would SIGTERM it, which the engine ignores, and then wait
        # for it forever: its pipe stays open in this process. Registered after that handler, so run first.
        atexit.register(self._kill_unstarted)

    def _start_process(self) -> _Spawned:
        ctx = mp.get_context("spawn")
        parent_in, child_out = ctx.Pipe(duplex=False)  # engine -> client
        child_in, parent_out = ctx.Pipe(duplex=False)  # client -> engine
        proc = ctx.Process(
            target=engine_main,
            args=(self.config, child_in, child_out, self._progress),
            name=f"sluice-engine-{self.config.node_id}",
            daemon=True,
        )
        proc.start()
        child_in.close()
        child_out.close()
        return _Spawned(proc, parent_in, parent_out)

    async def start(self, timeout_s: float = 300.0) -> EngineReady:
        """Spawn the engine process (unless `spawn()` did) and wait until its model is loaded; raises if
        it fails to."""
        spawned, self._spawned = self._spawned, None
        if spawned is None:
            spawned = self._start_process()
        else:
            atexit.unregister(self._kill_unstarted)
        self._loop = asyncio.get_running_loop()
        self._incarnation += 1
        incarnation = self._incarnation
        self._ready = self._loop.create_future()
        self._dead = asyncio.Event()
        self._outbox = queue.SimpleQueue()  # a fresh one: the previous writer thread may still hold the old
        self.dead_reason, self.info, self.stats = None, None, None
        self.fault, self.last_output_at = (0.0, False), 0.0
        self._proc = spawned.proc
        threading.Thread(target=self._read_loop, args=(spawned.inbox, incarnation), daemon=True).start()
        threading.Thread(target=self._write_loop, args=(spawned.outbox, self._outbox), daemon=True).start()
        try:
            self.info = await asyncio.wait_for(self._ready, timeout_s)
        except BaseException as exc:
            # Dead or half-started: make sure no process is left behind, and say why. A start cancelled (the
            # server stopping while the model loads) is a stop, not a death.
            if isinstance(exc, asyncio.CancelledError):
                self._on_dead(incarnation, "its start was cancelled", EngineShutDownError)
            else:
                self._on_dead(incarnation, f"failed to start: {str(exc) or type(exc).__name__}")
            await self._reap(0.0)
            raise
        return self.info

    def _kill_unstarted(self) -> None:
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            spawned.proc.kill()
            spawned.proc.join(5)

    async def restart(self, timeout_s: float = 300.0) -> None:
        """Replace a dead engine process with a fresh one (the supervisor's call)."""
        await self._reap(0.0)
        await self.start(timeout_s)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine on purpose; requests still on it end with EngineShutDownError."""
        self._send(Shutdown())
        self._on_dead(self._incarnation, "the engine was shut down", EngineShutDownError)
        await self._reap(timeout_s)

    async def wait_dead(self) -> str:
        """Return once the engine is dead (at once if it is), with why. A process that is gone
        without its pipe saying so (it cannot, today, but a wedged pipe must not hide a death) is
        noticed by polling."""
        while not self._dead.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dead.wait(), DEATH_POLL_S)
            proc = self._proc
            if not self._dead.is_set() and proc is not None and not proc.is_alive():
                self._on_dead(self._incarnation, f"the engine process exited (exit code {proc.exitcode})")
        return self.dead_reason or "dead"

    async def _reap(self, timeout_s: float) -> None:
        """End the current process (SIGKILL after `timeout_s`) and release its writer thread."""
        self._outbox.put(None)
        proc = self._proc
        if proc is None:
            return
        await asyncio.to_thread(proc.join, timeout_s)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, 5)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        proc = self._spawned.proc if self._spawned is not None else self._proc
        return proc.pid if proc else None

    # ----- requests --------------------------------------------------------------------

    def add(self, msg: AddRequest) -> asyncio.Queue[RequestOutput | EngineError]:
        """Send a request; its outputs, or the error it ended with, arrive on the returned queue.
        Raises EngineDeadError when the engine is not running."""
        if not self.alive:
            raise EngineDeadError(f"engine {self.config.node_id} is not running: {self.dead_reason}")
        data = msgspec.msgpack.encode(msg)  # first: a request that cannot be encoded leaves no stream behind
        stream: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        self._streams[msg.request_id] = stream
        self._outbox.put(data)
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

    # ----- threads ---------------------------------------------------------------------

    def _send(self, msg: ClientMessage) -> None:
        self._outbox.put(msgspec.msgpack.encode(msg))

    @staticmethod
    def _write_loop(conn, outbox: queue.SimpleQueue[bytes | None]) -> None:  # type: ignore[no-untyped-def]
        while True:
            data = outbox.get()
            if data is None:
                return
            try:
                conn.send_bytes(data)
            except OSError:
                return

    def _read_loop(self, conn, incarnation: int) -> None:  # type: ignore[no-untyped-def]
        decoder = msgspec.msgpack.Decoder(EngineMessage)
        loop = self._loop
        assert loop is not None
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
                    loop.call_soon_threadsafe(self._on_dead, incarnation, "the engine process exited")
                return
            loop.call_soon_threadsafe(self._dispatch, incarnation, decoder.decode(data))

    # ----- on the event loop -----------------------------------------------------------

    def _dispatch(self, incarnation: int, msg: EngineMessage) -> None:
        if incarnation != self._incarnation:
            return  # a late message of a process already replaced
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
            self._on_dead(incarnation, msg.error)

    def _on_dead(
        self, incarnation: int, reason: str, error: type[EngineDeadError] = EngineDeadError
    ) -> None:
        if incarnation != self._incarnation:
            return
        if self.dead_reason is None:
            self.dead_reason = reason
            level = logging.INFO if error is EngineShutDownError else logging.ERROR
            log.log(level, "engine %s %s: %s", self.config.node_id,
                    "stopped" if error is EngineShutDownError else "died", reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(reason))
        self._dead.set()
        self._fail_all(error, reason)

    def _fail_all(self, error: type[EngineDeadError], reason: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_nowait(error(reason))
