"""The SGLang driver: the `Driver` seam over SGLang servers' native HTTP API, as a node kind of the
fleet: cache-aware routing here, the failover loop the fleet's (`drivers/fleet/routed`).

    prompt ids --router (KV events | approximate tree, load guard)--> server A /generate (stream)
                                       A ==outputs o1..ok==> StreamDelta ==chunks==> client
                                       X  dies / hangs / is cut off
    prompt + t1..tk, max_new_tokens - k ----------------------> server B ==t(k+1)..==> client

Closing the stream early (the client went away) closes the connection, which SGLang takes as an
abort, and also POSTs /abort_request with the request's rid. Each server is a node of the same
health monitor the native engines and the fleet use: the gateway's receive time of every output
gives TTFT and inter-token latency (SGLang's stream carries no per-token timestamps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jinja2
import msgspec

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
from drivers.fleet.client import WorkerLost, WorkerRefused
from drivers.fleet.routed import RoutedDriver, WorkerTally
from drivers.fleet.wire import ErrorKind
from drivers.options import EngineOptions
from drivers.sglang import protocol
from drivers.sglang.client import SGLangClient
from drivers.sglang.config import SGLangConfig
from drivers.sglang.kv_events import KVEventSubscriber
from drivers.sglang.polling import poll_server
from drivers.sglang.router import CacheAwareRouter, ServerNode
from drivers.sglang.snapshot import load_trees, save_trees
from observability.node_health import NodeHealthMonitor, NodeStatus

log = logging.getLogger("sluice.sglang")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def server_id(address: str) -> str:
    parts = urlsplit(address)
    return parts.netloc or address


class SGLangDriver(RoutedDriver[ServerNode]):
    nodes_noun = "SGLang servers"

    def __init__(self, config: SGLangConfig, fleet: RoutedDriver[Any] | None = None) -> None:
        """`fleet`: the fleet driver these servers are a node kind of (`--driver fleet --sglang-servers`); they
        then share its node health, breakers, open-stream counts and tallies, and it drives the requests."""
        monitor = fleet.monitor if fleet is not None else NodeHealthMonitor([], config.node_health)
        self.router: CacheAwareRouter = CacheAwareRouter(config.routing, monitor, fleet.router if fleet else None)
        super().__init__(self.router, config.breaker, config.max_attempts)
        if fleet is not None:
            self.tallies = fleet.tallies
        self.config = config
        self.client = SGLangClient(config.api_key, config.timeouts)
        self.servers = [ServerNode(id=server_id(a.rstrip("/")), address=a.rstrip("/")) for a in config.servers]
        for i, endpoint in enumerate(config.kv_events):
            replay = config.kv_replay[i] if config.kv_replay else None
            self.router.events[self.servers[i].id] = KVEventSubscriber(self.servers[i].id, endpoint, replay)
        source = Path(config.chat_template).read_text() if config.chat_template else CHATML
        self.chat_template = jinja2.Environment(autoescape=False).from_string(source)
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    @classmethod
    def from_options(cls, options: EngineOptions) -> SGLangDriver:
        if options.sglang is None:
            raise ValueError("the sglang driver needs --sglang-servers URL,...")
        return cls(options.sglang)

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        for node in self.servers:
            self._breaker(node.id)
            poll = poll_server(self.client, node, self.config.poll_s, self.config.down_after_s)
            self._tasks.append(asyncio.create_task(poll, name=f"sluice-sglang-poll-{node.id}"))
        for subscriber in self.router.events.values():
            subscriber.start()
        self._load_snapshot()
        self._tasks.append(asyncio.create_task(self._watch_health(), name="sluice-sglang-health"))
        if self.config.snapshot_path:
            self._tasks.append(asyncio.create_task(self._snapshots(), name="sluice-sglang-snapshot"))
        self._started = True
        await self._wait_for_first(self._up, 0.05)
        log.info("sglang driver started: %d of %d servers up", len(self._up()), len(self.servers))

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for subscriber in self.router.events.values():
            await subscriber.stop()
        self._save_snapshot()
        await self.client.aclose()

    def _save_snapshot(self) -> None:
        if self.config.snapshot_path:
            save_trees(self.config.snapshot_path, self.router.trees, self.config.routing.page_size)

    def _load_snapshot(self) -> None:
        if self.config.snapshot_path:
            known = {n.id for n in self.servers}
            for sid, paths in load_trees(self.config.snapshot_path, self.config.routing.page_size).items():
                if sid in known:
                    for tokens in paths:
                        self.router.tree(sid).insert(tokens)

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_s)
            self._save_snapshot()

    def _up(self) -> list[ServerNode]:
        now = time.monotonic()
        return [n for n in self.servers if n.up and n.model and now - n.last_ok <= self.config.down_after_s]

    # ----- the seam --------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        """Every model a server was seen serving, up or not now: a request for it while its servers
        are down is a 503 (retry), not a 404."""
        cards: dict[str, ModelCard] = {}
        for node in self.servers:
            if node.model is None:
                continue
            known = cards.get(node.model)
            if known is None or node.max_model_len < known.max_model_len:
                cards[node.model] = ModelCard(id=node.model, max_model_len=node.max_model_len, owned_by="sglang")
        return sorted(cards.values(), key=lambda c: c.id)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        self._card(request.model)
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            text, special = self.chat_template.render(messages=messages, add_generation_prompt=True), False
        else:
            text, special = request.prompt or "", True
        return await self._tokenize_anywhere(request, lambda node: self.client.tokenize(node.address, text, special))

    def _card(self, model: str) -> ModelCard:
        card = next((c for c in self.models() if c.id == model), None)
        if card is None:
            if not self._up():
                raise OverloadedError("no SGLang server is up", retry_after=1.0)
            raise ModelNotFoundError(model)
        if not any(n.model == model for n in self._up()):
            raise OverloadedError(f"no SGLang server serving {model} is up", retry_after=1.0)
        return card

    def _candidates(self, model: str, tried: list[str]) -> list[ServerNode]:
        return self.router.candidates(self.servers, model, time.monotonic(), self.config.down_after_s, tried)

    def _choose(self, candidates: list[ServerNode], prompt: list[int], tenant_id: str | None) -> ServerNode:
        node, why = self.router.pick(candidates, prompt)
        log.debug("routed (%s)", why, extra={"node": node.id})
        return node

    def _load(self, node: ServerNode) -> float:
        return self.router.load(node)

    def _failed(self, node: ServerNode, exc: WorkerLost) -> None:
        super()._failed(node, exc)
        if exc.definite:
            node.up, node.detail = False, str(exc)  # refused connection: out of the view until a poll says up

    async def _attempt(
        self, node: ServerNode, request: GenerationRequest, rid: str, prompt: list[int], sent: list[int], budget: int,
    ) -> AsyncGenerator[GenerationChunk, None]:
        body = protocol.generate_body(request, rid, prompt + sent, budget - len(sent))
        delta = protocol.StreamDelta(node.incremental, request.stop, request.logprobs)
        self.router.routed(node.id, prompt)
        arrival = time.time()
        first_token: float | None = None
        last_token: float | None = None
        finished = False
        try:
            async with contextlib.aclosing(self.client.stream(node.address, body)) as outputs:
                async for out in outputs:
                    d = delta.feed(out)
                    now = time.time()
                    aborted = d.finish if d.finish is not None and d.finish.type == "abort" else None
                    if aborted is not None:
                        # We never abort a stream we still read, so the server ended it (queue full, bad
                        # input, shutting down): a refusal before any token, else resume elsewhere.
                        finished = True
                        d = msgspec.structs.replace(d, finish=None)
                        if not d.token_ids:
                            raise _abort_refusal(aborted, node, sent_any=bool(sent))
                    if d.token_ids:
                        if first_token is None:
                            first_token = now
                        elif last_token is not None:
                            gap = (now - last_token) / len(d.token_ids)
                            for _ in d.token_ids:
                                self.monitor.record_itl(node.id, now, gap, max(1, self.router.in_flight[node.id]))
                        self.monitor.record_progress(node.id, now)
                        last_token = now
                    sent.extend(d.token_ids)
                    reason = protocol.finish_reason(d.finish) if d.finish is not None else None
                    final = reason is not None
                    yield GenerationChunk(
                        request_id=request.request_id, text=d.text, token_ids=d.token_ids,
                        prompt_tokens=len(prompt), completion_tokens=len(sent), finish_reason=reason,
                        logprobs=d.logprobs, node_id=node.id, token_time=last_token,
                        arrival_time=arrival if final else None, first_token_time=first_token if final else None,
                        finish_time=now if final else None,
                        cached_tokens=min(d.cached_tokens, len(prompt)) if final else None,
                    )
                    if aborted is not None:
                        raise _abort_refusal(aborted, node, sent_any=True)
                    if final:
                        finished = True
                        return
        finally:
            if not finished:
                # Our stream closed early (client gone, shutdown) or the server failed: make sure it
                # lets go of the request even if a proxy keeps the upstream connection open.
                await asyncio.shield(self.client.abort(node.address, rid))

    async def abort(self, request_id: str) -> None:
        """Closing the generate iterator is what aborts (its connection closes and /abort_request is
        posted); a request that is not open here is a no-op."""

    async def health(self) -> DriverHealth:
        if not self._started:
            return DriverHealth(ready=False, detail="the sglang driver is not started")
        up = self._up()
        return DriverHealth(
            ready=bool(up),
            detail="" if up else "no SGLang server is up",
            starting=not up and not any(n.last_ok for n in self.servers),
            degraded=len(up) < len(self.servers),
            running=sum(n.running for n in up),
            waiting=sum(n.waiting for n in up),
        )

    def nodes(self) -> NodesReport:
        views = {a.node: a for a in self.monitor.assessments()}
        out = []
        for node in self.servers:
            a = views.get(node.id)
            breaker = self.router.breakers.get(node.id)
            tally = self.tallies.get(node.id, WorkerTally())
            status = str(a.status) if a else "healthy"
            if not node.up:
                status = "dead"
            out.append(NodeInfo(
                id=node.id, status=status, running=node.running, waiting=node.waiting,
                itl_p50_ms=milliseconds(a.itl_p50_s) if a else None, itl_p99_ms=milliseconds(a.itl_p99_s) if a else None,
                ttft_p50_ms=milliseconds(a.ttft_p50_s) if a else None,
                reason=(a.reason if a else None) if node.up else node.detail, since=a.since if a else None,
                restarts=node.restarts, address=node.address, state="ready" if node.up else "down",
                circuit=str(breaker.state) if breaker else "closed", in_flight=self.router.in_flight.get(node.id, 0),
                requests=tally.requests, errors=tally.errors, failovers=tally.failovers,
                kv_usage=node.kv_usage, load_source=node.load_source,
            ))
        events = [NodeEvent(ev.time, ev.node, str(ev.kind), ev.reason) for ev in self.monitor.events]
        return NodesReport(out, events)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.monitor.config.eval_interval_s)
            now = time.time()
            for node in self.servers:
                if node.up and self.monitor.status(node.id) is NodeStatus.DEAD:
                    self.monitor.mark_restarted(node.id, now)  # back: judged afresh
                elif not node.up and node.last_ok and self.monitor.status(node.id) is not NodeStatus.DEAD:
                    self.monitor.mark_dead(node.id, node.detail or "down", now)
                self.monitor.set_in_flight(node.id, self.router.in_flight.get(node.id, 0), now)
            for event in self.monitor.evaluate(now):
                log.warning("node %s", event.kind, extra={"node": event.node, "reason": event.reason})


def _abort_refusal(finish: protocol.FinishInfo, node: ServerNode, sent_any: bool) -> Exception:
    """SGLang ended the request itself: a refusal (bad input; a full queue before any token) or a
    lost server (anything else: the request resumes on another one)."""
    message = finish.message or "aborted by the server"
    if finish.status_code in (400, 413, 422):
        return WorkerRefused(ErrorKind.INVALID, message)
    if finish.status_code in (429, 503) and not sent_any:
        return WorkerRefused(ErrorKind.OVERLOADED, message)
    return WorkerLost(f"{node.id}: aborted by the server: {message}")

