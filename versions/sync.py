"""Keeps one replica in step with the registry: its routing table and the versions it hosts.

The database is the truth; Redis only says "read it again". Every change an admin makes is followed by
a PUBLISH on `sluice:model-registry`; every replica is SUBSCRIBEd and re-reads the registry when a
message comes, so a new alias generation is applied within a database read of the change (well under
a second). Should a message be lost (Redis down, a replica reconnecting), a periodic re-read
(`refresh_s`, 5 s) catches up. Without Redis (one replica, SQLite) the periodic read is the only
path for changes made elsewhere; changes made through this replica apply at once.

Each read also reconciles what this replica hosts with the registry:

    version state        hosted here?   action
    loading / ready      no             load it (in the background; a failure is logged and not
                                        retried until the version's row changes)
    anything else        yes            wait until no request holds it (leases), unload it
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from drivers.hosting import DeployRefusedError, VersionHost, VersionSource
from versions.names import HOSTED_STATES
from versions.repository import RegistryRepository, RegistrySnapshot
from versions.routing import ModelRouter, RoutingTable

log = logging.getLogger("sluice.versions")

CHANNEL = "sluice:model-registry"
LEASE_POLL_S = 0.05


@dataclass(frozen=True)
class SyncConfig:
    redis_url: str | None = None
    """Where replicas tell each other to re-read the registry (REDIS_URL); None: periodic reads only."""
    refresh_s: float = 5.0
    """Period of the fallback re-read (SLUICE_REGISTRY_REFRESH_S)."""
    channel: str = CHANNEL


class RegistrySync:
    def __init__(
        self, repo: RegistryRepository, router: ModelRouter, host: VersionHost | None, config: SyncConfig
    ) -> None:
        self.repo = repo
        self.router = router
        self.host = host
        self.config = config
        self.snapshot: RegistrySnapshot | None = None
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._unloads: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, object] = {}  # version id -> the row version whose load failed here
        self._redis: Any = None

    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._periodic(), name="registry-refresh"))
        if self.config.redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(self.config.redis_url)
            self._tasks.append(asyncio.create_task(self._listen(), name="registry-listen"))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._loads.values(), *self._unloads.values()]:
            task.cancel()
        for task in [*self._tasks, *self._loads.values(), *self._unloads.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._redis is not None:
            await self._redis.aclose()

    # ----- reading the registry -------------------------------------------------------------

    async def refresh(self) -> RoutingTable:
        async with self._lock:
            snapshot = await self.repo.snapshot()
            self.snapshot = snapshot
            self._reconcile(snapshot)
            hosted = self.host.hosted() if self.host is not None else {}
            return self.router.apply(snapshot, hosted)

    async def notify(self) -> None:
        """After a change through this replica: apply it here, then tell the others."""
        await self.refresh()
        if self._redis is None:
            return
        try:
            await self._redis.publish(self.config.channel, "changed")
        except Exception as exc:  # noqa: BLE001 - the periodic read still carries the change
            log.warning("could not notify the other replicas: %s", exc)

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("reading the model registry failed")

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self._redis.pubsub()
                await pubsub.subscribe(self.config.channel)
                await self.refresh()  # whatever changed while we were not subscribed
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: reconnect, the periodic read meanwhile
                log.warning("model registry notifications interrupted: %s", exc)
                await asyncio.sleep(1.0)

    # ----- hosting ----------------------------------------------------------------------------

    def _reconcile(self, snapshot: RegistrySnapshot) -> None:
        host = self.host
        if host is None:
            return
        hosted = host.hosted()
        for vid, record in snapshot.versions.items():
            wanted = record.state in HOSTED_STATES
            if wanted and vid not in hosted and vid not in self._loads:
                if self._failed.get(vid) == record.updated_at:
                    continue
                source = VersionSource(vid, record.source, record.dtype)
                self._loads[vid] = asyncio.create_task(self._load(source, record.updated_at), name=f"load-{vid}")
            elif not wanted and vid in hosted and vid not in self._unloads:
                self._unloads[vid] = asyncio.create_task(self._unload(vid), name=f"unload-{vid}")

    async def _load(self, source: VersionSource, row_version: object) -> None:
        assert self.host is not None
        try:
            await self.host.load(source)
        except DeployRefusedError as exc:
            self._failed[source.version_id] = row_version
            log.error("loading %s failed here: %s (%s)", source.version_id, exc, exc.reason)
            return
        finally:
            self._loads.pop(source.version_id, None)
        await self.refresh()  # route by any generation that waited for this version

    async def _unload(self, vid: str) -> None:
        assert self.host is not None
        try:
            while self.router.leases.get(vid, 0) > 0:  # requests pinned to it at admission still run
                await asyncio.sleep(LEASE_POLL_S)
            await self.host.unload(vid)
        finally:
            self._unloads.pop(vid, None)

    async def unloaded(self, vid: str) -> None:
        """Wait until this replica no longer hosts `vid`."""
        while True:
            task = self._unloads.get(vid)
            if task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
            elif self.host is None or vid not in self.host.hosted():
                return
            else:
                await self.refresh()
                await asyncio.sleep(LEASE_POLL_S)
