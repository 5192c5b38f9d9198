"""The fleet driver: the `Driver` seam over `sluice worker` processes, with failover.

The failover loop is the fleet's (`routed.RoutedDriver`); this module says what is particular to
`sluice worker`s: membership (a static list or Redis heartbeats), the router's policies, the
worker wire (`wire`), the workers' own per-token timestamps for inter-token latency, and prompts
tokenized in the gateway with the workers' own tokenizer (`tokenizers`) once it has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from drivers.base import (
    DriverHealth,
    GenerationChunk,
    GenerationRequest,
    ModelCard,
    ModelNotFoundError,
    NodeEvent,
    NodeInfo,
    NodesReport,
    OverloadedError,
    milliseconds,
)
from drivers.fleet import wire
from drivers.fleet.client import WorkerClient, WorkerLost
from drivers.fleet.config import FleetConfig
from drivers.fleet.membership import Membership, RedisMembership, StaticMembership
from drivers.fleet.routed import RoutedDriver, WorkerTally
from drivers.fleet.router import FleetRouter, prefix_key
from drivers.fleet.routing import NoWorkerError
from drivers.fleet.tokenizers import GatewayTokenizers
from drivers.fleet.wire import WorkerInfo, WorkerState
from drivers.options import EngineOptions
from observability.node_health import NodeHealthMonitor, NodeStatus

if TYPE_CHECKING:
    from drivers.sglang.driver import SGLangDriver
    from drivers.sglang.router import ServerNode

log = logging.getLogger("sluice.fleet")

# A prompt shorter than this is tokenized on the event loop (tens of microseconds); a longer one in a
# worker thread, like the engines do, so a 1 MiB prompt never stalls the other streams.
INLINE_TOKENIZE_CHARS = 4096


class FleetDriver(RoutedDriver["WorkerInfo | ServerNode"]):
    """`sluice worker`s, and SGLang servers as a second node kind when `config.sglang` names some: a
    request for a model goes to the nodes that serve it, whichever kind (both: the kind whose least
    loaded node is less loaded picks, each by its own policy); the failover loop is the same."""

    def __init__(self, config: FleetConfig) -> None:
        self.router: FleetRouter = FleetRouter(config.router, NodeHealthMonitor([], config.node_health))
        super().__init__(self.router, config.breaker, config.max_attempts)
        self.config = config
        self.membership: Membership
        if config.redis_url:
            self.membership = RedisMembership(config.redis_url, config.rescan_s, config.ttl_s)
        else:
            self.membership = StaticMembership(list(config.workers), config.rescan_s, config.ttl_s, config.secret)
        self.client = WorkerClient(config.secret, config.timeouts, config.tls_verify)
        self.tokenizers = GatewayTokenizers(self.client)
        self.tokenized_here = 0  # prompts tokenized by this gateway, not sent to a worker for it
        self._watch: asyncio.Task[None] | None = None
        self._started = False
        self.sglang: SGLangDriver | None = None
        if config.sglang is not None:
            from drivers.sglang.driver import SGLangDriver

            self.sglang = SGLangDriver(config.sglang, fleet=self)

    @classmethod
    def from_options(cls, options: EngineOptions) -> FleetDriver:
        if options.fleet is None:
            raise ValueError("the fleet driver needs --workers URL,..., --fleet-redis URL or --sglang-servers URL,...")
        return cls(options.fleet)

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self.membership.start()
        self._watch = asyncio.create_task(self._watch_health(), name="sluice-fleet-health")
        if self.sglang is not None:
            await self.sglang.start()
        self._started = True
        await self._wait_for_first(lambda: self._ready_workers() or self._servers_up(), 0.1)
        log.info("fleet driver started: %d workers ready, %d SGLang servers up", len(self._ready_workers()),
                 len(self._servers_up()))

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.membership.stop()
        if self.sglang is not None:
            await self.sglang.stop()
        await self.tokenizers.aclose()
        await self.client.aclose()

    def _ready_workers(self) -> list[WorkerInfo]:
        return [w for w in self.membership.view.values() if w.state is WorkerState.READY]

    def _servers_up(self) -> list[ServerNode]:
        return self.sglang._up() if self.sglang is not None else []

    def _workers_serve(self, model: str) -> bool:
        return any(card.id == model for w in self._ready_workers() for card in w.models)

    def _servers_serve(self, model: str) -> bool:
        return self.sglang is not None and any(c.id == model for c in self.sglang.models())

    # ----- the seam --------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        cards: dict[str, ModelCard] = {}
        served = [card for w in self._ready_workers() for card in w.models]
        if self.sglang is not None:
            served += self.sglang.models()
        for card in served:
            known = cards.get(card.id)
            if known is None or card.max_model_len < known.max_model_len:
                cards[card.id] = card
        return sorted(cards.values(), key=lambda c: c.id)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        if self.sglang is not None and not self._workers_serve(request.model) and self._servers_serve(request.model):
            return await self.sglang.tokenize(request)
        if not any(c.id == request.model for c in self.models()):
            if not self._ready_workers() and not self._servers_up():
                raise OverloadedError("no fleet worker is ready", retry_after=1.0)
            raise ModelNotFoundError(request.model)
        local = self.tokenizers.for_model(request.model, self._ready_workers())
        if local is not None:
            self.tokenized_here += 1
            if _prompt_chars(request) < INLINE_TOKENIZE_CHARS:
                return local.prompt_ids(request)
            return await asyncio.to_thread(local.prompt_ids, request)  # a long prompt: off the event loop
        body = wire.TokenizeRequest(model=request.model, prompt=request.prompt,
                                    prompt_token_ids=request.prompt_token_ids, messages=request.messages)
        return await self._tokenize_anywhere(request, lambda worker: self.client.tokenize(worker.address, body))

    def _candidates(self, model: str, tried: list[str]) -> list[WorkerInfo | ServerNode]:
        """Both kinds' candidates; NoWorkerError, naming why for each kind, only when neither has one."""
        found: list[WorkerInfo | ServerNode] = []
        why: list[str] = []
        try:
            found.extend(self.router.candidates(self.membership.view, model, time.monotonic(), tried))
        except NoWorkerError as exc:
            why.append(str(exc))
        if self.sglang is not None:
            try:
                found.extend(self.sglang._candidates(model, tried))
            except NoWorkerError as exc:
                why.append(str(exc))
        if not found:
            raise NoWorkerError("; ".join(why))
        return found

    def _choose(
        self, candidates: list[WorkerInfo | ServerNode], prompt: list[int], tenant_id: str | None
    ) -> WorkerInfo | ServerNode:
        workers = [c for c in candidates if isinstance(c, WorkerInfo)]
        servers = [c for c in candidates if not isinstance(c, WorkerInfo)]
        if servers and self.sglang is not None and (
            not workers or min(map(self._load, servers)) < min(map(self._load, workers))
        ):
            return self.sglang._choose(servers, prompt, tenant_id)
        return self.router.pick(workers, prompt, tenant_id, self.membership.view)

    def _load(self, node: WorkerInfo | ServerNode) -> float:
        if isinstance(node, WorkerInfo):
            return self.router.load(node)
        assert self.sglang is not None
        return self.sglang._load(node)

    def _failed(self, node: WorkerInfo | ServerNode, exc: WorkerLost) -> None:
        if isinstance(node, WorkerInfo) or self.sglang is None:
            super()._failed(node, exc)
        else:
            self.sglang._failed(node, exc)

    def _card(self, model: str) -> ModelCard:
        if self.sglang is not None and not self._workers_serve(model) and self._servers_serve(model):
            return self.sglang._card(model)  # its servers are down: 503, not 404
        card = next((c for c in self.models() if c.id == model), None)
        if card is None:
            raise ModelNotFoundError(model)
        return card

    async def _attempt(
        self, worker: WorkerInfo | ServerNode, request: GenerationRequest, rid: str, prompt: list[int],
        sent: list[int], budget: int,
    ) -> AsyncGenerator[GenerationChunk, None]:
        if not isinstance(worker, WorkerInfo):
            assert self.sglang is not None
            async with contextlib.aclosing(self.sglang._attempt(worker, request, rid, prompt, sent, budget)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        submit = self._submit(request, rid, prompt, sent, budget, worker,
                              prefix_key(prompt, request.tenant_id, self.router.config))
        trace = {"traceparent": request.trace_parent} if request.trace_parent else None  # worker span's parent
        last_token: float | None = None
        async with contextlib.aclosing(self.client.stream(worker.address, submit, trace)) as events:
            async for event in events:
                last_token = self._record_itl(worker.id, event, last_token)
                sent.extend(event.token_ids)
                yield self._chunk(request.request_id, event, len(prompt), len(sent), worker.id)
                if event.finish_reason is not None:
                    return

    @staticmethod
    def _submit(
        request: GenerationRequest, rid: str, prompt: list[int], sent: list[int], budget: int, worker: WorkerInfo,
        key: int | None,
    ) -> wire.SubmitRequest:
        r = request
        return wire.SubmitRequest(
            request_id=rid,
            model=r.model,
            prompt_token_ids=prompt + sent,
            sampling=wire.SamplingSpec(
                max_tokens=budget - len(sent), temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                min_p=r.min_p, repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
                frequency_penalty=r.frequency_penalty, seed=r.seed, stop=r.stop, stop_token_ids=r.stop_token_ids,
                ignore_eos=r.ignore_eos, logprobs=r.logprobs, logit_bias=r.logit_bias,
            ),
            priority=r.priority, tenant_id=r.tenant_id, tenant_weight=r.tenant_weight,
            resumed_tokens=len(sent), incarnation=worker.incarnation, prefix_key=key,
        )

    def _record_itl(self, worker_id: str, event: wire.TokensEvent, last: float | None) -> float | None:
        """Inter-token latency from the worker's own timestamps (the network's jitter is not the
        engine's); returns the time of the event's last token."""
        if event.token_times:  # the stall watchdog's evidence of life, by this host's clock (no skew)
            self.monitor.record_progress(worker_id, time.time())
        for t in event.token_times:
            if last is not None:
                self.monitor.record_itl(worker_id, t, max(0.0, t - last), max(1, self.router.in_flight[worker_id]))
            last = t
        return last

    @staticmethod
    def _chunk(request_id: str, e: wire.TokensEvent, prompt_tokens: int, completion: int, node: str) -> GenerationChunk:
        return GenerationChunk(
            request_id=request_id, text=e.text, token_ids=e.token_ids, prompt_tokens=prompt_tokens,
            completion_tokens=completion, finish_reason=e.finish_reason, logprobs=e.logprobs,
            arrival_time=e.arrival_time, first_scheduled_time=e.first_scheduled_time,
            first_token_time=e.first_token_time, finish_time=e.finish_time, node_id=node,
            token_time=e.token_times[-1] if e.token_times else None, preemption_times=e.preemption_times,
            # A resumed request's prompt holds the output sent before: only the original prompt counts.
            cached_tokens=None if e.cached_tokens is None else min(e.cached_tokens, prompt_tokens),
        )

    async def abort(self, request_id: str) -> None:
        """Closing the generate iterator is what aborts (its connection closes, the worker aborts);
        a request that is not open here is a no-op."""

    async def health(self) -> DriverHealth:
        ready = self._ready_workers()
        loads = [w.load for w in ready]
        if not self._started:
            return DriverHealth(ready=False, detail="the fleet driver is not started")
        everyone = len(self.membership.view)
        servers = await self.sglang.health() if self.sglang is not None else None
        return DriverHealth(
            ready=bool(ready) or (servers is not None and servers.ready),
            detail="" if ready or (servers is not None and servers.ready) else "no fleet worker is ready",
            degraded=len(ready) < everyone or (servers is not None and servers.degraded),
            running=sum(x.running for x in loads) + (servers.running if servers else 0),
            waiting=sum(x.waiting for x in loads) + (servers.waiting if servers else 0),
            kv_blocks_used=sum(x.kv_blocks_used for x in loads),
            kv_blocks_total=sum(x.kv_blocks_total for x in loads),
            generation_tokens_per_s=sum(x.generation_tokens_per_s for x in loads),
            prompt_tokens_per_s=sum(x.prompt_tokens_per_s for x in loads),
            max_waiting=sum(x.max_waiting for x in loads),
            max_num_seqs=sum(x.max_num_seqs for x in loads),
            prefix_cache_hit_rate=sum(x.prefix_cache_hit_rate for x in loads) / len(loads) if loads else 0.0,
        )

    def nodes(self) -> NodesReport:
        views = {a.node: a for a in self.monitor.assessments()}
        nodes = []
        for wid, w in sorted(self.membership.view.items()):
            a = views.get(wid)
            breaker = self.router.breakers.get(wid)
            tally = self.tallies.get(wid, WorkerTally())
            nodes.append(NodeInfo(
                id=wid, status=str(a.status) if a else "healthy", running=w.load.running, waiting=w.load.waiting,
                kv_blocks_used=w.load.kv_blocks_used, kv_blocks_total=w.load.kv_blocks_total,
                tokens_per_s=round(w.load.generation_tokens_per_s, 2),
                itl_p50_ms=milliseconds(a.itl_p50_s) if a else None, itl_p99_ms=milliseconds(a.itl_p99_s) if a else None,
                ttft_p50_ms=milliseconds(a.ttft_p50_s) if a else None, reason=a.reason if a else None,
                since=a.since if a else None, prefix_cache_hit_rate=w.load.prefix_cache_hit_rate,
                address=w.address, state=str(w.state), incarnation=w.incarnation,
                circuit=str(breaker.state) if breaker else "closed", in_flight=self.router.in_flight.get(wid, 0),
                requests=tally.requests, errors=tally.errors, failovers=tally.failovers,
            ))
        if self.sglang is not None:
            nodes += self.sglang.nodes().nodes
        events = [NodeEvent(ev.time, ev.node, str(ev.kind), ev.reason) for ev in self.monitor.events]
        return NodesReport(nodes, events)

    async def _watch_health(self) -> None:
        """Node health of the workers, once per interval: new workers join the monitor, the router's
        own open streams are the in-flight count the stall watchdog needs."""
        while True:
            await asyncio.sleep(self.monitor.config.eval_interval_s)
            now = time.time()
            for wid in self.membership.view:
                self._breaker(wid)
                if self.monitor.status(wid) is NodeStatus.DEAD:
                    self.monitor.mark_restarted(wid, now)  # back in the view: judged afresh
                self.monitor.set_in_flight(wid, self.router.in_flight.get(wid, 0), now)
            servers = {n.id for n in self.sglang.servers} if self.sglang is not None else set()
            for wid in self.router.breakers:
                if wid in servers:
                    continue  # SGLang servers: their own poll says up or down (drivers/sglang/driver.py)
                if wid not in self.membership.view and self.monitor.status(wid) is not NodeStatus.DEAD:
                    self.monitor.mark_dead(wid, "left the fleet (no heartbeat)", now)
            for event in self.monitor.evaluate(now):
                log.warning("node %s", event.kind, extra={"node": event.node, "reason": event.reason})


def _prompt_chars(request: GenerationRequest) -> int:
    if request.messages is not None:
        return sum(len(m.content) for m in request.messages)
    return len(request.prompt or "")
