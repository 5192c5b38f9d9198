"""Running a worker: uvicorn, the Redis registration, and the SIGTERM drain.

    start      take an incarnation (Redis INCR; without Redis the start time in ms), listen, load the
               engine (JOINING), then READY; heartbeats carry state and load every interval
    SIGTERM    DRAINING at once (heartbeat now + pub/sub, /readyz 503, new submits refused with
               503 shutting_down so a router retries elsewhere), the open streams finish (up to
               --drain-timeout), then the record is deleted and the process exits 0
    SIGTERM x2 uvicorn's own shutdown: whatever still runs is cut off (gateways fail it over)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from drivers.base import Driver
from drivers.fleet.membership import WorkerRegistration
from gateway.server_choice import SERVER_HTTP, SERVER_LOOP
from worker.app import WorkerApp
from worker.settings import WorkerSettings

log = logging.getLogger("sluice.worker")


class WorkerServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: WorkerApp) -> None:
        super().__init__(config)
        self.worker = app
        self.registration: WorkerRegistration | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.worker.settings
        if s.redis_url:
            self.registration = WorkerRegistration(
                s.redis_url, s.worker_id, self.worker.info, s.heartbeat_interval_s, s.heartbeat_ttl_s
            )
            self.worker.incarnation = await self.registration.register()
            self.worker.on_state_change(self.registration.changed)
            self.registration.start()
        else:
            self.worker.incarnation = int(time.time() * 1000)  # a restart is always newer
        log.info("worker %s incarnation %d at %s", s.worker_id, self.worker.incarnation, s.address)
        try:
            await super().serve(sockets)
        finally:
            if self.registration is not None:
                await self.registration.leave()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(), name="sluice-worker-drain")

    async def _drain_then_exit(self) -> None:
        try:
            finished = await self.worker.drain(self.worker.settings.drain_timeout_s)
            log.warning("drained" if finished else "drain timeout: exiting with requests still open")
        finally:
            self.should_exit = True


def run_worker(settings: WorkerSettings, driver: Driver) -> int:
    app = WorkerApp(settings, driver)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        log_config=None,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn takes seconds, float too
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile,
        loop=SERVER_LOOP,
        http=SERVER_HTTP,
    )
    print(f"Sluice worker {settings.worker_id} listening on {settings.address} (driver {settings.driver})", flush=True)
    WorkerServer(config, app).run()
    return 0
