"""The native engine as a version host: one `NativeDriver` per model version, sized from its headers.

`sluice serve --driver native` builds `versioned_native_driver`: the model it was started with is the
boot driver, and the model registry can load more versions beside it (drivers/versioned.py). Each
version's engines are configured as the boot model's (KV pool size, batch sizes, engines per model),
with the version's own source, dtype, served name and node ids.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

from drivers.hosting import DeployRefusal, DeployRefusedError, Footprint, VersionSource
from drivers.native import NativeDriver, NativeDriverConfig
from drivers.options import EngineOptions
from drivers.versioned import VersionedDriver
from engine_native.model.errors import ModelLoadError, ModelNotFoundError, UnsupportedArchitectureError
from engine_native.model.inspect import inspect_model
from engine_native.sizing import DEFAULT_MAX_KV_BYTES, available_memory_bytes


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class NativeVersionFactory:
    def __init__(self, base: NativeDriverConfig, budget_bytes: int | None = None) -> None:
        self.base = base
        self.budget_bytes: int | None = budget_bytes if budget_bytes is not None else physical_memory_bytes()

    def boot_source(self) -> VersionSource:
        engine = self.base.engine
        return VersionSource(self.base.served_model_name, engine.model_path, engine.dtype)

    async def inspect(self, source: VersionSource) -> Footprint:
        return await asyncio.to_thread(self._footprint, source)

    def _footprint(self, source: VersionSource) -> Footprint:
        try:
            summary = inspect_model(source.source, source.dtype)
        except ModelNotFoundError as exc:
            raise DeployRefusedError(DeployRefusal.MISSING_SOURCE, str(exc)) from exc
        except UnsupportedArchitectureError as exc:
            raise DeployRefusedError(DeployRefusal.UNSUPPORTED_ARCHITECTURE, str(exc)) from exc
        except (ModelLoadError, ValueError) as exc:  # ValueError: a dtype the engine does not compute in
            raise DeployRefusedError(DeployRefusal.INVALID_SOURCE, str(exc)) from exc
        engines = self.base.num_engines
        return Footprint(summary.architecture, summary.weight_bytes * engines, self._kv_bytes() * engines)

    def _kv_bytes(self) -> int:
        """An engine's KV pool: the configured size, else what the engine would take (engine_native/sizing.py;
        the real pool may be smaller, never larger)."""
        cache = self.base.engine.cache
        if cache.memory_bytes is not None:
            return cache.memory_bytes
        return min(int(available_memory_bytes() * cache.memory_fraction), DEFAULT_MAX_KV_BYTES)

    def build(self, source: VersionSource) -> NativeDriver:
        engine = replace(
            self.base.engine, model_path=source.source, dtype=source.dtype, served_model_name=source.version_id
        )
        return NativeDriver(replace(self.base, engine=engine, node_prefix=f"{source.version_id}/node",
                                    progress=False))


def versioned_native_driver(options: EngineOptions) -> VersionedDriver:
    config = NativeDriverConfig.from_options(options)
    return VersionedDriver(NativeDriver(config), NativeVersionFactory(config, options.model_memory_budget_bytes))
