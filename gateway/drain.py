"""Graceful shutdown: drain first, then exit.

On the first SIGTERM (or SIGINT) `sluice serve` does not stop listening; it drains:

    1. new requests get 503 + Retry-After (OpenAI error body) and /readyz says 503, so a load
       balancer takes the replica out while /healthz stays 200;
    2. the requests in flight run on, up to `Settings.drain_timeout_s` (SLUICE_DRAIN_TIMEOUT_S);
    3. whatever still runs then is ended cleanly: the driver is stopped, so each request ends with
       `ShuttingDownError`: a stream gets an SSE error event and [DONE], a request with no output
       yet a JSON 503; each one's usage is recorded as it ends, like any other ending;
    4. uvicorn shuts down: the tenancy lifespan flushes the usage records, the driver lifespan
       stops the (already stopped) driver, and the process exits with 0.

A second signal skips what is left of the drain (uvicorn's own shutdown, 5 s for open connections).
A signal sent to the whole process group reaches the engine processes too; they ignore it
(engine_native/process.py) and go when the drain stops the driver.
Probes (/healthz, /readyz) and /metrics are neither counted nor refused.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from litestar.types import ASGIApp, Receive, Scope, Send

from drivers.base import Driver, ShuttingDownError

log = logging.getLogger("sluice.gateway")

RETRY_AFTER_S = 1.0  # what a request refused while draining is told: another replica can take it now
END_GRACE_S = 10.0  # how long requests ended by the drain get to write their last bytes
_UNCOUNTED = frozenset({"/healthz", "/readyz", "/metrics"})


class Drain:
    """Counts the requests in flight and refuses new ones once draining."""

    def __init__(self, driver: Driver, timeout_s: float) -> None:
        self.driver = driver
        self.timeout_s = timeout_s
        self.draining = False
        self.exit_code = 0  # set to 1 when the process stops because it could not start its driver
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] in _UNCOUNTED:
                await app(scope, receive, send)
                return
            if self.draining:  # raised inside the app: gateway.errors turns it into the 503
                raise ShuttingDownError("The server is shutting down; retry the request", retry_after=RETRY_AFTER_S)
            self.in_flight += 1
            self._idle.clear()
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._idle.set()

        return counted

    async def run(self) -> None:
        """Steps 1-3 above; returns when nothing runs any more (or the end grace ran out)."""
        self.draining = True
        log.warning("draining", extra={"in_flight": self.in_flight, "drain_timeout_s": self.timeout_s})
        if await self._wait_idle(self.timeout_s):
            log.warning("drained: every request finished")
            return
        log.warning("drain timeout: ending the requests still running", extra={"in_flight": self.in_flight})
        await self.driver.stop()
        if not await self._wait_idle(END_GRACE_S):
            log.error("requests still running after the driver stopped", extra={"in_flight": self.in_flight})

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains (`Drain.run`) before the shutdown begins."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started and self.drain.exit_code != 0:
            # The app stopped itself before listening (its driver failed at once: gateway/app.py). uvicorn's way
            # would raise the signal again once it is done, and the process would die of it (status 143, which
            # systemd's Restart=on-failure takes for a clean stop) instead of exiting with its status.
            self.should_exit = True
            return
        if self._drain_started or not self.started or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal, or one before we listen: uvicorn's way
            return
        # Not appended to uvicorn's captured signals: a drained server exits normally (status 0).
        self._drain_started = True
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(), name="sluice-drain")

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        except Exception:
            log.exception("draining failed")
        finally:
            self.should_exit = True
