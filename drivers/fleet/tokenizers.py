"""The gateway's own copies of the workers' prompt tokenizers (drivers/portable_tokenizer.py).

A model's prompts are tokenized here when every ready worker serving it names the same tokenizer
fingerprint in its heartbeat and this gateway holds that tokenizer; otherwise they go to a worker
(POST /fleet/v1/tokenize) as before, while the tokenizer is fetched in the background from a
worker that names it. Workers of one model that disagree (a rolling change of tokenizer) send
every prompt back to the workers until they agree again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable

from drivers.fleet.client import WorkerClient, WorkerLost, WorkerRefused
from drivers.fleet.wire import WorkerInfo
from drivers.portable_tokenizer import PromptTokenizer

log = logging.getLogger("sluice.fleet")

KEEP = 8  # tokenizers held (by fingerprint): versions of a few models
RETRY_S = 10.0  # a failed fetch is tried again after this long


class GatewayTokenizers:
    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self._held: OrderedDict[str, PromptTokenizer] = OrderedDict()
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}

    def for_model(self, model: str, ready: Iterable[WorkerInfo]) -> PromptTokenizer | None:
        """The tokenizer every ready worker of `model` uses, if this gateway holds it; starts
        fetching it when it does not."""
        serving = [w for w in ready if any(card.id == model for card in w.models)]
        named = {w.tokenizers.get(model) for w in serving}
        if len(named) != 1:
            return None
        fp = named.pop()
        if fp is None:
            return None
        held = self._held.get(fp)
        if held is not None:
            self._held.move_to_end(fp)
            return held
        if fp not in self._fetching and time.monotonic() - self._failed_at.get(fp, -RETRY_S) >= RETRY_S:
            task = asyncio.create_task(self._fetch(model, fp, serving), name=f"sluice-fleet-tokenizer-{model}")
            self._fetching[fp] = task
            task.add_done_callback(lambda _: self._fetching.pop(fp, None))
        return None

    async def _fetch(self, model: str, fp: str, workers: list[WorkerInfo]) -> None:
        for worker in workers:
            try:
                spec = await self.client.tokenizer(worker.address, model)
                tokenizer = await asyncio.to_thread(PromptTokenizer, spec)  # a large one parses for 100s of ms
            except (WorkerLost, WorkerRefused) as exc:
                log.warning("fetching the tokenizer of %s failed: %s", model, exc, extra={"node": worker.id})
                continue
            if tokenizer.fingerprint != fp:  # it changed since the heartbeat: the next one will say
                log.warning("worker %s sent a tokenizer of %s other than it named", worker.id, model)
                continue
            self._held[fp] = tokenizer
            while len(self._held) > KEEP:
                self._held.popitem(last=False)
            log.info("tokenizing prompts of %s in the gateway (tokenizer %s)", model, fp[:12])
            return
        self._failed_at[fp] = time.monotonic()

    async def aclose(self) -> None:
        for task in list(self._fetching.values()):
            task.cancel()
        await asyncio.gather(*self._fetching.values(), return_exceptions=True)
