"""The model registry one gateway process runs: repository, sync with the other replicas, admin service.

Started by the app's lifespan after the tenancy (it shares the tenant database) and stopped before it.
The driver is the version host when it can host versions (the native driver); otherwise the registry
still records names and aliases, and deploys are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from drivers.base import Driver
from drivers.hosting import HostedVersion, VersionHost
from gateway.settings import Settings
from versions.repository import RegistryRepository
from versions.routing import ModelRouter
from versions.service import VersionService
from versions.sync import RegistrySync, SyncConfig


@dataclass
class ModelRegistry:
    service: VersionService
    sync: RegistrySync
    _hosting: asyncio.Task[None] | None = field(default=None)

    @classmethod
    async def start(
        cls, settings: Settings, sessions: async_sessionmaker[AsyncSession], driver: Driver, router: ModelRouter,
        driver_started: asyncio.Event,
    ) -> ModelRegistry:
        repo = RegistryRepository(sessions)
        sync = RegistrySync(repo, router, None, SyncConfig(settings.redis_url, settings.registry_refresh_s))
        await sync.start()
        registry = cls(VersionService(repo, sync), sync)
        if isinstance(driver, VersionHost):
            registry._hosting = asyncio.create_task(registry._host_when_started(driver, driver_started))
        return registry

    async def _host_when_started(self, host: VersionHost, started: asyncio.Event) -> None:
        # Before the boot model runs, a version with its source could not adopt its engine.
        await started.wait()
        self.sync.host = host
        await self.sync.refresh()

    def hosted(self) -> dict[str, HostedVersion]:
        host = self.sync.host
        return host.hosted() if host is not None else {}

    async def stop(self) -> None:
        if self._hosting is not None:
            self._hosting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hosting
        await self.service.stop()
        await self.sync.stop()
