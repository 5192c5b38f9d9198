"""The fleet driver: the `Driver` seam over `sluice worker` processes, with failover.

One request's life (`generate`):

    prompt ids ----pick(filter, score)----> worker A ==tokens t1..tk==> client
                                               X  dies / hangs / is cut off
    prompt + t1..tk, max_tokens - k --pick(not A)--> worker B ==t(k+1)..==> client

Before the first token the retry is invisible; after it, B resumes from the prompt plus every
token the client already has, with the remaining budget, so the client's stream neither repeats
nor skips a token (greedy output is the uninterrupted one). At most `max_attempts` workers per
request. A worker that fails gets a strike on its circuit breaker; one that refuses (full,
draining) is simply skipped for this request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from drivers.base import (
    Driver,
    DriverError,
    DriverHealth,
    EngineDeadError,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    NodeEvent,
    NodeInfo,
    NodesReport,
    OverloadedError,
    ShuttingDownError,
)
from drivers.fleet import wire
from drivers.fleet.breaker import CircuitBreaker
from drivers.fleet.client import WorkerClient, WorkerLost, WorkerRefused
from drivers.fleet.config import FleetConfig
from drivers.fleet.membership import Membership, RedisMembership, StaticMembership
from drivers.fleet.router import FleetRouter, NoWorkerError
from drivers.fleet.wire import ErrorKind, WorkerInfo, WorkerState
from drivers.options import EngineOptions
from observability.node_health import NodeHealthMonitor, NodeStatus

log = logging.getLogger("sluice.fleet")

# Refusals another worker may not repeat: try the next one.
_RETRY_ELSEWHERE = frozenset({
    ErrorKind.OVERLOADED, ErrorKind.SHUTTING_DOWN, ErrorKind.ENGINE_DEAD, ErrorKind.FENCED, ErrorKind.MODEL_NOT_FOUND,
})
JOIN_WAIT_S = 5.0  # start() waits this long for a first ready worker (readiness follows later ones)


@dataclass
class WorkerTally:
    """What this gateway sent one worker and how it went (per-worker counters on /metrics)."""

    requests: int = 0  # attempts sent (a failed-over request counts on each worker it tried)
    errors: int = 0  # attempts lost (WorkerLost)
    failovers: int = 0  # requests moved off this worker to another one after a loss here


class FleetDriver(Driver):
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        # httpx logs every request at INFO: a line per token stream and per membership poll.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.monitor = NodeHealthMonitor([], config.node_health)
        self.router = FleetRouter(config.router, self.monitor)
        self.membership: Membership
        if config.redis_url:
            self.membership = RedisMembership(config.redis_url, config.rescan_s, config.ttl_s)
        else:
            self.membership = StaticMembership(list(config.workers), config.rescan_s, config.ttl_s, config.secret)
        self.client = WorkerClient(config.secret, config.timeouts, config.tls_verify)
        self.failovers = 0  # requests moved to another worker after a failure
        self.tallies: dict[str, WorkerTally] = {}
        self._watch: asyncio.Task[None] | None = None
        self._started = False

    @classmethod
    def from_options(cls, options: EngineOptions) -> FleetDriver:
        if options.fleet is None:
            raise ValueError("the fleet driver needs --workers URL,... or --fleet-redis URL")
        return cls(options.fleet)

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self.membership.start()
        self._watch = asyncio.create_task(self._watch_health(), name="sluice-fleet-health")
        self._started = True
        deadline = time.monotonic() + JOIN_WAIT_S
        while not self._ready_workers() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log.info("fleet driver started: %d workers ready", len(self._ready_workers()))

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.membership.stop()
        await self.client.aclose()

    def _ready_workers(self) -> list[WorkerInfo]:
        return [w for w in self.membership.view.values() if w.state is WorkerState.READY]

    # ----- the seam --------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        cards: dict[str, ModelCard] = {}
        for worker in self._ready_workers():
            for card in worker.models:
                known = cards.get(card.id)
                if known is None or card.max_model_len < known.max_model_len:
                    cards[card.id] = card
        return sorted(cards.values(), key=lambda c: c.id)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        if not any(c.id == request.model for c in self.models()):
            if not self._ready_workers():
                raise OverloadedError("no fleet worker is ready", retry_after=1.0)
            raise ModelNotFoundError(request.model)
        body = wire.TokenizeRequest(model=request.model, prompt=request.prompt,
                                    prompt_token_ids=request.prompt_token_ids, messages=request.messages)
        tried: list[str] = []
        while True:
            # The least-loaded worker, whatever the policy: tokenizing takes no KV and no turn.
            worker = self._pick(request.model, [], request.tenant_id, tried, any_worker=True)
            try:
                return await self.client.tokenize(worker.address, body)
            except WorkerLost as exc:
                self._failed(worker, exc)
                tried.append(worker.id)
                if len(tried) >= self.config.max_attempts:
                    raise EngineDeadError(f"tokenizing failed on {len(tried)} workers: {exc}") from exc
            except WorkerRefused as exc:
                if exc.kind not in _RETRY_ELSEWHERE:
                    raise _driver_error(exc, request.model) from exc
                tried.append(worker.id)

    def _pick(
        self, model: str, prompt: list[int], tenant_id: str | None, tried: list[str], any_worker: bool = False
    ) -> WorkerInfo:
        view = self.membership.view
        try:
            candidates = self.router.candidates(view, model, time.time(), tried)
        except NoWorkerError as exc:
            raise EngineDeadError(str(exc)) from exc
        if any_worker:
            worker = min(candidates, key=lambda c: (self.router.load(c), c.id))
        else:
            worker = self.router.pick(candidates, prompt, tenant_id, view)
        self._breaker(worker.id).picked()
        return worker

    def _breaker(self, worker_id: str) -> CircuitBreaker:
        breaker = self.router.breakers.get(worker_id)
        if breaker is None:
            breaker = self.router.breakers[worker_id] = CircuitBreaker(self.config.breaker)
            self.monitor.add_node(worker_id, time.time())
        return breaker

    def _failed(self, worker: WorkerInfo, exc: WorkerLost) -> None:
        self._breaker(worker.id).failed(time.time(), definite=exc.definite)
        log.warning("worker failed: %s", exc, extra={"node": worker.id})

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        prompt = request.tokenized_prompt
        if prompt is None:
            prompt = await self.tokenize(request)
        card = next((c for c in self.models() if c.id == request.model), None)
        if card is None:
            raise ModelNotFoundError(request.model)
        budget = request.max_tokens if request.max_tokens is not None else card.max_model_len - len(prompt)
        if budget < 1:
            raise InvalidRequestError(
                f"This model's maximum context length is {card.max_model_len} tokens; the prompt has {len(prompt)}",
                param="max_tokens")
        trace = {"traceparent": request.trace_parent} if request.trace_parent else None  # worker span's parent
        sent: list[int] = []  # token ids the client has: what a resumed attempt continues from
        tried: list[str] = []
        last_failure = ""
        refused: WorkerRefused | None = None
        while True:
            try:
                worker = self._pick(request.model, prompt, request.tenant_id, tried)
            except EngineDeadError as exc:
                if refused is not None and not sent:
                    raise _driver_error(refused, request.model) from exc  # every worker said no: say why
                raise EngineDeadError(f"{exc}; last failure: {last_failure}" if last_failure else str(exc)) from exc
            submit = self._submit(request, prompt, sent, budget, worker, attempt=len(tried))
            self.router.in_flight[worker.id] = self.router.in_flight.get(worker.id, 0) + 1
            tally = self.tallies.setdefault(worker.id, WorkerTally())
            tally.requests += 1
            arrival = time.time()
            got_token = False
            last_token: float | None = None
            try:
                async with contextlib.aclosing(self.client.stream(worker.address, submit, trace)) as events:
                    async for event in events:
                        if not got_token and event.token_ids:
                            got_token = True
                            self._breaker(worker.id).succeeded()
                            self.monitor.record_ttft(worker.id, time.time(), time.time() - arrival, len(prompt))
                        last_token = self._record_itl(worker.id, event, last_token)
                        sent.extend(event.token_ids)
                        yield self._chunk(request.request_id, event, len(prompt), len(sent), worker.id)
                        if event.finish_reason is not None:
                            return
            except WorkerLost as exc:
                self._failed(worker, exc)
                tally.errors += 1
                tried.append(worker.id)
                last_failure = str(exc)
                if len(tried) >= self.config.max_attempts:
                    raise EngineDeadError(f"the request failed on {len(tried)} workers; last: {exc}") from exc
                self.failovers += 1
                tally.failovers += 1
                log.warning("failover after %d tokens", len(sent),
                            extra={"request_id": request.request_id, "node": worker.id, "error": str(exc)})
            except WorkerRefused as exc:
                self._breaker(worker.id).succeeded()  # it answered: alive
                if exc.kind not in _RETRY_ELSEWHERE:
                    raise _driver_error(exc, request.model) from exc
                tried.append(worker.id)
                refused = exc
            finally:
                self.router.in_flight[worker.id] -= 1

    def _submit(
        self, request: GenerationRequest, prompt: list[int], sent: list[int], budget: int, worker: WorkerInfo,
        attempt: int,
    ) -> wire.SubmitRequest:
        r = request
        return wire.SubmitRequest(
            # A fresh id per attempt: a worker that still holds an earlier attempt never sees a duplicate.
            request_id=r.request_id if attempt == 0 else f"{r.request_id}.{attempt}",
            model=r.model,
            prompt_token_ids=prompt + sent,
            sampling=wire.SamplingSpec(
                max_tokens=budget - len(sent), temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                min_p=r.min_p, repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
                frequency_penalty=r.frequency_penalty, seed=r.seed, stop=r.stop, stop_token_ids=r.stop_token_ids,
                ignore_eos=r.ignore_eos, logprobs=r.logprobs,
            ),
            priority=r.priority, tenant_id=r.tenant_id, tenant_weight=r.tenant_weight,
            resumed_tokens=len(sent), incarnation=worker.incarnation,
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
        return DriverHealth(
            ready=bool(ready),
            detail="" if ready else "no fleet worker is ready",
            degraded=len(ready) < everyone,
            running=sum(x.running for x in loads),
            waiting=sum(x.waiting for x in loads),
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
                itl_p50_ms=_ms(a.itl_p50_s) if a else None, itl_p99_ms=_ms(a.itl_p99_s) if a else None,
                ttft_p50_ms=_ms(a.ttft_p50_s) if a else None, reason=a.reason if a else None,
                since=a.since if a else None, prefix_cache_hit_rate=w.load.prefix_cache_hit_rate,
                address=w.address, state=str(w.state), incarnation=w.incarnation,
                circuit=str(breaker.state) if breaker else "closed", in_flight=self.router.in_flight.get(wid, 0),
                requests=tally.requests, errors=tally.errors, failovers=tally.failovers,
            ))
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
            for wid in self.router.breakers:
                if wid not in self.membership.view and self.monitor.status(wid) is not NodeStatus.DEAD:
                    self.monitor.mark_dead(wid, "left the fleet (no heartbeat)", now)
            for event in self.monitor.evaluate(now):
                log.warning("node %s", event.kind, extra={"node": event.node, "reason": event.reason})


def _driver_error(exc: WorkerRefused, model: str) -> DriverError:
    """The one mapping of a worker's refusal to the driver seam's errors."""
    retry = exc.retry_after if exc.retry_after is not None else 1.0
    if exc.kind is ErrorKind.INVALID:
        return InvalidRequestError(str(exc), exc.param)
    if exc.kind is ErrorKind.MODEL_NOT_FOUND:
        return ModelNotFoundError(model)
    if exc.kind is ErrorKind.SHUTTING_DOWN:
        return ShuttingDownError(str(exc), retry_after=retry)
    if exc.kind is ErrorKind.OVERLOADED:
        return OverloadedError(str(exc), retry_after=retry)
    return EngineDeadError(f"worker refused: {exc}")


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 3) if seconds is not None else None

