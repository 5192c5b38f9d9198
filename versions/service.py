"""The admin operations on the model registry, each recorded with its time and admin.

    register  a version: its source (a .gguf file or a Hugging Face folder) and dtype     registered
    deploy    check (source there, architecture supported, fits the memory budget), then
              load and warm it here; the other replicas load it when they hear of it     -> loading -> ready
    alias     {version: weight} as generation g + 1, if the caller saw g (compare-and-set)
    rollback  the weights of the generation before the newest, as a new generation
    release   after each alias change: a ready version an older generation named, but neither
              of the newest two (nor a tenant's pin) does, drains and is unloaded
              everywhere, freeing its memory; it can be deployed again                -> draining -> registered
    retire    refused while the alias points at the version; otherwise it drains (no new
              request; those running finish) and is unloaded on every replica              -> draining -> retired

A deploy refused by the checks changes nothing but the change log. A deploy whose load fails puts
the version back to `registered` with the reason. Neither touches the alias or the versions serving.
"""

from __future__ import annotations

import asyncio
import logging

from drivers.hosting import DeployRefusedError, VersionHost, VersionSource
from versions.errors import NoHostError, RegistryConflictError
from versions.names import VersionState, check_model_name, check_version_name, check_weights, version_id
from versions.repository import AliasRecord, ChangeRecord, RegistryRepository, VersionRecord
from versions.sync import RegistrySync

log = logging.getLogger("sluice.versions")

DTYPES = ("auto", "float32", "bfloat16")

_S = VersionState


class VersionService:
    def __init__(self, repo: RegistryRepository, sync: RegistrySync) -> None:
        self.repo = repo
        self.sync = sync
        self._retiring: set[asyncio.Task[None]] = set()

    async def register(self, model: str, version: str, source: str, dtype: str, actor: str) -> VersionRecord:
        check_model_name(model)
        check_version_name(version)
        record = await self.repo.register(model, version, source, dtype, actor)
        await self.sync.notify()
        return record

    async def deploy(self, model: str, version: str, actor: str) -> VersionRecord:
        record = await self.repo.version(model, version)
        host = self._host()
        if record.state not in (_S.REGISTERED, _S.LOADING, _S.READY):
            raise RegistryConflictError(f"{record.id} is {record.state.value}; register a new version instead")
        source = VersionSource(record.id, record.source, record.dtype)
        if record.id in host.hosted():
            return record
        try:
            await host.check(source)
        except DeployRefusedError as exc:
            await self.repo.log_refusal(model, version, "deploy_refused", f"{exc.reason.value}: {exc}", actor)
            raise
        if record.state != _S.REGISTERED:  # deployed through another replica: load it here too
            await host.load(source)
            await self.sync.refresh()
            return record
        await self.repo.set_state(model, version, _S.LOADING, actor, expect=frozenset({_S.REGISTERED}),
                                  action="deploy")
        await self.sync.notify()  # the other replicas start loading meanwhile
        try:
            await host.load(source)
        except DeployRefusedError as exc:
            await self.repo.set_state(model, version, _S.REGISTERED, actor, expect=frozenset({_S.LOADING}),
                                      action="deploy_failed", detail=f"{exc.reason.value}: {exc}")
            await self.sync.notify()
            raise
        record = await self.repo.set_state(model, version, _S.READY, actor, expect=frozenset({_S.LOADING}),
                                           action="ready")
        await self.sync.notify()
        return record

    async def set_alias(self, model: str, weights: dict[str, int], expected: int, actor: str) -> AliasRecord:
        check_model_name(model)
        alias = await self.repo.write_alias(model, check_weights(weights), expected, actor, "alias")
        await self.sync.notify()
        await self._release_unreferenced(model, actor)
        return alias

    async def rollback(self, model: str, expected: int | None, actor: str) -> AliasRecord:
        """The weights of generation g - 1 become generation g + 1 (`expected`: the g the caller saw)."""
        current = (await self.repo.snapshot()).aliases.get(check_model_name(model))
        if current is None:
            raise RegistryConflictError(f"{model} has no alias to roll back")
        if expected is not None and expected != current.generation:
            raise RegistryConflictError(
                f"the alias of {model} is at generation {current.generation}, not {expected}: read it again"
            )
        previous = await self.repo.generation(model, current.generation - 1)
        if previous is None:
            raise RegistryConflictError(f"{model} has no generation before {current.generation}")
        alias = await self.repo.write_alias(model, previous.weights, current.generation, actor, "rollback")
        await self.sync.notify()
        await self._release_unreferenced(model, actor)
        return alias

    async def retire(self, model: str, version: str, actor: str) -> VersionRecord:
        record = await self.repo.version(model, version)
        if record.state == _S.REGISTERED:  # never deployed: nothing to drain
            record = await self.repo.set_state(model, version, _S.RETIRED, actor,
                                               expect=frozenset({_S.REGISTERED}), action="retire")
            await self.sync.notify()
            return record
        record = await self.repo.set_state(model, version, _S.DRAINING, actor,
                                           expect=frozenset({_S.LOADING, _S.READY}), action="retire")
        await self.sync.notify()  # every replica stops routing to it and unloads it once drained
        self._after_drain(model, version, _S.RETIRED, "retired", actor)
        return record

    async def _release_unreferenced(self, model: str, actor: str) -> None:
        """Versions the alias left behind free their memory (rollback stays instant: the generation
        before the newest keeps its versions loaded)."""
        try:
            released = await self.repo.release_unreferenced(model, actor)
        except Exception:  # the alias change stands; the next one releases what this one could not
            log.exception("releasing the versions %s no longer references failed", model)
            return
        if not released:
            return
        await self.sync.notify()  # every replica stops routing to them and unloads them once drained
        for version in released:
            log.info("version %s released: no alias references it", version_id(model, version))
            self._after_drain(model, version, _S.REGISTERED, "unloaded", actor)

    def _after_drain(self, model: str, version: str, state: VersionState, action: str, actor: str) -> None:
        task = asyncio.create_task(self._finish_draining(model, version, state, action, actor),
                                   name=f"{action}-{version_id(model, version)}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _finish_draining(self, model: str, version: str, state: VersionState, action: str, actor: str) -> None:
        """Once this replica has unloaded it (the others do so on their own), `state`."""
        vid = version_id(model, version)
        try:
            await self.sync.unloaded(vid)
            await self.repo.set_state(model, version, state, actor, expect=frozenset({_S.DRAINING}), action=action)
            await self.sync.notify()
        except Exception:
            log.exception("draining %s did not finish", vid)

    async def changes(self, model: str) -> list[ChangeRecord]:
        return await self.repo.changes(check_model_name(model))

    async def stop(self) -> None:
        for task in list(self._retiring):
            task.cancel()

    def _host(self) -> VersionHost:
        host = self.sync.host  # set once the driver has started, if it can host versions at all
        if host is None:
            raise NoHostError("this server cannot load model versions now: its driver is not started, "
                              "or cannot host versions (use the native driver)")
        return host
