"""Several model versions on one host, each in its own engine set, behind one driver.

    VersionedDriver
      boot driver       the model the server started with, under its served name ("smollm2-...")
      engine per version   loaded on demand (`load`), under its version id ("chat@v2"); each is a
                        whole driver of its own (engine processes, KV pool, prefix cache): KV blocks
                        and cached prefixes are never shared between versions
      ids -> engine     a request's `model` picks the engine; the engine sees its own served name

A version whose source and dtype are those of an engine already running (the boot model registered
as a version) adopts that engine instead of loading a second copy. Every engine counts its requests
in flight; `unload` takes an engine's ids away at once, waits until nothing runs on it, then stops it.
Loads are checked first (`check`): missing files, unsupported architectures and versions that would
take the host past its memory budget are refused before anything is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from drivers.base import (
    Driver,
    DriverHealth,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    NodesReport,
)
from drivers.hosting import DeployRefusal, DeployRefusedError, Footprint, HostedVersion, VersionSource
from drivers.portable_tokenizer import TokenizerSpec

log = logging.getLogger(__name__)


class VersionFactory(Protocol):
    """How one kind of engine is inspected and built for a version (drivers/native_versions.py)."""

    budget_bytes: int | None  # memory all hosted versions may take together; None: no bound

    def boot_source(self) -> VersionSource | None:
        """What the boot driver serves, to adopt it when that source is registered as a version."""
        ...

    async def inspect(self, source: VersionSource) -> Footprint:
        """Raises DeployRefusedError (missing, unsupported, unreadable)."""
        ...

    def build(self, source: VersionSource) -> Driver: ...


@dataclass(eq=False)
class _Engine:
    driver: Driver
    served_name: str  # what the engine itself calls its model
    source: VersionSource | None
    footprint: Footprint | None
    names: set[str] = field(default_factory=set)  # plain served names (the boot model's)
    versions: set[str] = field(default_factory=set)  # version ids it serves
    in_flight: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def same_source(self, source: VersionSource) -> bool:
        mine = self.source
        return mine is not None and mine.dtype == source.dtype and _real(mine.source) == _real(source.source)


def _real(path: str) -> str:
    return os.path.realpath(path)


class VersionedDriver(Driver):
    def __init__(self, boot: Driver, factory: VersionFactory) -> None:
        self._boot = boot
        self._factory = factory
        self._engines: list[_Engine] = []
        self._by_id: dict[str, _Engine] = {}
        self._loading: dict[str, asyncio.Task[Footprint]] = {}
        self._reserved: dict[str, int] = {}  # bytes of loads in progress, counted against the budget
        self._budget = asyncio.Lock()
        # Routed to from the start: while it loads, the boot driver itself answers 503 (loading).
        names = {card.id for card in boot.models()}
        self._boot_engine = _Engine(boot, next(iter(names), ""), factory.boot_source(), None, names=names)
        self._add(self._boot_engine)

    # ----- lifecycle -------------------------------------------------------------------

    def begin_start(self) -> None:
        self._boot.begin_start()

    async def start(self) -> None:
        engine = self._boot_engine
        # Sized while the boot model loads, not after it serves: reading a GGUF's metadata holds the GIL for
        # ~2.7 s on a 2-core host and leaves ~95k memmaps for the collector, which the first requests waited behind.
        sizing = asyncio.create_task(self._factory.inspect(engine.source)) if engine.source is not None else None
        try:
            await self._boot.start()
        except BaseException:
            if sizing is not None:
                sizing.cancel()
                await asyncio.gather(sizing, return_exceptions=True)
            raise
        if sizing is not None:
            try:
                engine.footprint = await sizing
            except DeployRefusedError as exc:  # it loaded, so it serves; only its size is unknown
                log.warning("cannot estimate the boot model's memory: %s", exc)

    async def stop(self) -> None:
        loading = list(self._loading.values())
        for task in loading:
            task.cancel()
        await asyncio.gather(*loading, return_exceptions=True)
        engines, self._engines, self._by_id = self._engines, [], {}
        await asyncio.gather(*(e.driver.stop() for e in engines), return_exceptions=True)

    def _add(self, engine: _Engine) -> None:
        self._engines.append(engine)
        for name in engine.names | engine.versions:
            self._by_id[name] = engine

    # ----- hosting (drivers.hosting.VersionHost) ------------------------------------------

    def hosted(self) -> dict[str, HostedVersion]:
        return {
            vid: HostedVersion(vid, e.footprint, e.in_flight, e.draining)
            for vid, e in self._by_id.items() if vid in e.versions
        }

    def _adoptable(self, source: VersionSource) -> _Engine | None:
        return next((e for e in self._engines if not e.draining and e.same_source(source)), None)

    async def check(self, source: VersionSource) -> Footprint:
        footprint = await self._factory.inspect(source)
        if self._adoptable(source) is None:
            self._check_budget(source, footprint)
        return footprint

    def _check_budget(self, source: VersionSource, footprint: Footprint) -> None:
        budget = self._factory.budget_bytes
        if budget is None:
            return
        used = sum(e.footprint.total_bytes for e in self._engines if e.footprint is not None)
        used += sum(b for vid, b in self._reserved.items() if vid != source.version_id)
        if used + footprint.total_bytes > budget:
            raise DeployRefusedError(
                DeployRefusal.OVER_BUDGET,
                f"{source.version_id} needs about {_mib(footprint.total_bytes)} (weights "
                f"{_mib(footprint.weight_bytes)}, KV {_mib(footprint.kv_bytes)}); {_mib(used)} of the "
                f"{_mib(budget)} memory budget is taken by the versions hosted here",
            )

    async def load(self, source: VersionSource) -> Footprint:
        engine = self._by_id.get(source.version_id)
        if engine is not None and source.version_id in engine.versions:
            return engine.footprint or await self._factory.inspect(source)
        task = self._loading.get(source.version_id)
        if task is None:  # one load per version, however many callers wait on it
            task = asyncio.create_task(self._load(source), name=f"load-{source.version_id}")
            self._loading[source.version_id] = task
            task.add_done_callback(lambda _: self._loading.pop(source.version_id, None))
        return await asyncio.shield(task)

    async def _load(self, source: VersionSource) -> Footprint:
        async with self._budget:  # checks and reservations one at a time: two loads cannot both fit
            footprint = await self._factory.inspect(source)
            adopted = self._adoptable(source)
            if adopted is not None:
                adopted.versions.add(source.version_id)
                self._by_id[source.version_id] = adopted
                log.info("version %s adopts the engine of %s", source.version_id, adopted.served_name)
                return adopted.footprint or footprint
            self._check_budget(source, footprint)
            self._reserved[source.version_id] = footprint.total_bytes
        try:
            driver = self._factory.build(source)
            try:
                await driver.start()
            except asyncio.CancelledError:  # the server stops while it loads: no engine may outlive it
                await asyncio.shield(driver.stop())
                raise
            except Exception as exc:
                await driver.stop()
                raise DeployRefusedError(DeployRefusal.LOAD_FAILED, f"{source.version_id}: {exc}") from exc
            served = next((c.id for c in driver.models()), source.version_id)
            self._add(_Engine(driver, served, source, footprint, versions={source.version_id}))
            log.info("version %s loaded (%s)", source.version_id, _mib(footprint.total_bytes))
            return footprint
        finally:
            self._reserved.pop(source.version_id, None)

    async def unload(self, version_id: str) -> None:
        engine = self._by_id.get(version_id)
        if engine is None or version_id not in engine.versions:
            return
        engine.versions.discard(version_id)
        del self._by_id[version_id]
        if engine.versions:  # another version still uses this engine
            return
        engine.draining = True
        for name in engine.names:  # the boot model's plain name goes with its engine
            self._by_id.pop(name, None)
        if engine.in_flight:
            engine.idle.clear()
            await engine.idle.wait()
        self._engines.remove(engine)
        await engine.driver.stop()
        log.info("version %s unloaded", version_id)

    # ----- the seam --------------------------------------------------------------------

    def _engine(self, model: str) -> _Engine:
        engine = self._by_id.get(model)
        if engine is None or engine.draining:
            raise ModelNotFoundError(model)
        return engine

    def models(self) -> list[ModelCard]:
        cards = []
        for model_id, engine in self._by_id.items():
            own = engine.driver.models()
            if own:
                cards.append(msgspec.structs.replace(own[0], id=model_id))
        return cards

    def tokenizer_spec(self, model: str) -> TokenizerSpec | None:
        engine = self._by_id.get(model)
        return engine.driver.tokenizer_spec(engine.served_name) if engine is not None and not engine.draining else None

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        engine = self._engine(request.model)
        return await engine.driver.tokenize(msgspec.structs.replace(request, model=engine.served_name))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        engine = self._engine(request.model)
        inner = msgspec.structs.replace(request, model=engine.served_name)
        engine.in_flight += 1
        try:
            # Closed explicitly: a client gone closes this generator, and that must abort in the engine now.
            stream = engine.driver.generate(inner)
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                closer = getattr(stream, "aclose", None)
                if closer is not None:
                    await closer()
        finally:
            engine.in_flight -= 1
            if engine.in_flight == 0:
                engine.idle.set()

    async def abort(self, request_id: str) -> None:
        for engine in list(self._engines):
            await engine.driver.abort(request_id)

    async def health(self) -> DriverHealth:
        healths = [await e.driver.health() for e in self._engines if not e.draining]
        if len(healths) == 1:
            return healths[0]
        if not healths:
            return DriverHealth(ready=False, detail="no model is loaded")
        return combine_health(healths)

    def nodes(self) -> NodesReport:
        reports = [e.driver.nodes() for e in self._engines]
        return NodesReport(
            [n for r in reports for n in r.nodes],
            sorted((ev for r in reports for ev in r.events), key=lambda ev: ev.time),
        )

    async def set_fault(self, node_id: str, step_delay_s: float, stall: bool) -> None:
        for engine in self._engines:
            if any(n.id == node_id for n in engine.driver.nodes().nodes):
                await engine.driver.set_fault(node_id, step_delay_s, stall)
                return
        if not self._engines:
            raise InvalidRequestError("the driver is not started")
        await self._engines[0].driver.set_fault(node_id, step_delay_s, stall)


def combine_health(healths: list[DriverHealth]) -> DriverHealth:
    """One figure for several engine sets: counts and rates add up; ready if any is, live if all are."""
    values: dict[str, Any] = {}
    for name in DriverHealth.__struct_fields__:
        items = [getattr(h, name) for h in healths]
        if name == "ready":
            values[name] = any(items)
        elif name == "live":
            values[name] = all(items)
        elif name == "degraded":
            values[name] = any(items) or not all(h.ready for h in healths)
        elif name == "detail":
            values[name] = "; ".join(i for i in items if i)
        elif name == "prefix_cache_hit_rate":
            values[name] = sum(items) / len(items)
        elif name == "timestamp":
            values[name] = min((i for i in items if i), default=0.0)
        elif isinstance(items[0], dict):
            total: dict[int, int] = {}
            for item in items:
                for key, value in item.items():
                    total[key] = total.get(key, 0) + value
            values[name] = total
        else:
            values[name] = sum(items)
    return DriverHealth(**values)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
