"""The failover loop every driver of the fleet shares, whatever kind of node it routes to
(`sluice worker`s in `driver`, SGLang servers in `drivers/sglang/driver`).

One request's life (`RoutedDriver.generate`):

    prompt ids ----pick(filter, score)----> node A ==tokens t1..tk==> client
                                               X  dies / hangs / is cut off
    prompt + t1..tk, max_tokens - k --pick(not A)--> node B ==t(k+1)..==> client

Before the first token the retry is invisible; after it, B resumes from the prompt plus every
token the client already has, with the remaining budget, so the client's stream neither repeats
nor skips a token (greedy output is the uninterrupted one). At most `max_attempts` nodes per
request. A node that fails (`WorkerLost`) gets a strike on its circuit breaker; one that refuses
(`WorkerRefused`: full, draining) is simply skipped for this request, unless the refusal is one
another node would repeat (bad input), which goes to the client at once.

A node kind supplies what differs: the candidates (`_candidates`), the pick among them
(`_choose`), its load (`_load`), its model cards (`_card`) and one attempt's stream (`_attempt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sized
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from drivers.base import (
    Driver,
    DriverError,
    EngineDeadError,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelCard,
    ModelNotFoundError,
    OverloadedError,
    ShuttingDownError,
)
from drivers.fleet.breaker import BreakerConfig, CircuitBreaker
from drivers.fleet.client import WorkerLost, WorkerRefused
from drivers.fleet.routing import NodeFilter, NoWorkerError
from drivers.fleet.wire import ErrorKind
from observability.node_health import NodeHealthMonitor

log = logging.getLogger("sluice.fleet")

JOIN_WAIT_S = 5.0  # start() waits this long for a first node that can serve

# Refusals another node may not repeat: try the next one.
RETRY_ELSEWHERE = frozenset({
    ErrorKind.OVERLOADED, ErrorKind.SHUTTING_DOWN, ErrorKind.ENGINE_DEAD, ErrorKind.FENCED, ErrorKind.MODEL_NOT_FOUND,
})


class Node(Protocol):
    @property
    def id(self) -> str: ...


NodeT = TypeVar("NodeT", bound=Node)


@dataclass
class WorkerTally:
    """What this gateway sent one node and how it went (per-node counters on /metrics)."""

    requests: int = 0  # attempts sent (a failed-over request counts on each node it tried)
    errors: int = 0  # attempts lost (WorkerLost)
    failovers: int = 0  # requests moved off this node to another one after a loss here


class RoutedDriver(Driver, Generic[NodeT]):
    nodes_noun = "workers"  # in error messages: "the request failed on 3 workers"

    def __init__(self, router: NodeFilter, breaker: BreakerConfig, max_attempts: int) -> None:
        # httpx logs every request at INFO: a line per token stream and per poll.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.router = router
        self.monitor: NodeHealthMonitor = router.monitor
        self.breaker_config = breaker
        self.max_attempts = max_attempts
        self.failovers = 0  # requests moved to another node after a failure
        self.tallies: dict[str, WorkerTally] = {}

    # ----- what a node kind supplies ------------------------------------------------------

    def _candidates(self, model: str, tried: list[str]) -> list[NodeT]:
        """The nodes that may take a request for `model` now; raises NoWorkerError."""
        raise NotImplementedError

    def _choose(self, candidates: list[NodeT], prompt: list[int], tenant_id: str | None) -> NodeT:
        raise NotImplementedError

    def _load(self, node: NodeT) -> float:
        raise NotImplementedError

    def _card(self, model: str) -> ModelCard:
        """The model's card; raises ModelNotFoundError, or OverloadedError while no node serving it is up."""
        raise NotImplementedError

    def _attempt(
        self, node: NodeT, request: GenerationRequest, rid: str, prompt: list[int], sent: list[int], budget: int
    ) -> AsyncGenerator[GenerationChunk, None]:
        """One node's stream of the request, resumed after the `sent` tokens with `budget - len(sent)`
        left; extends `sent` with every token it hands out; raises WorkerLost or WorkerRefused."""
        raise NotImplementedError

    async def _wait_for_first(self, up: Callable[[], Sized], poll_s: float) -> None:
        """start()'s wait for a first node that can serve (readiness follows later ones)."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while not up() and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)

    # ----- picking ------------------------------------------------------------------------

    def _pick(
        self, model: str, prompt: list[int], tenant_id: str | None, tried: list[str], any_node: bool = False
    ) -> NodeT:
        try:
            candidates = self._candidates(model, tried)
        except NoWorkerError as exc:
            raise EngineDeadError(str(exc)) from exc
        if any_node:  # the least loaded, whatever the policy: tokenizing takes no KV and no turn
            node = min(candidates, key=lambda n: (self._load(n), n.id))
        else:
            node = self._choose(candidates, prompt, tenant_id)
        self._breaker(node.id).picked()
        return node

    def _breaker(self, node_id: str) -> CircuitBreaker:
        breaker = self.router.breakers.get(node_id)
        if breaker is None:
            breaker = self.router.breakers[node_id] = CircuitBreaker(self.breaker_config)
            self.monitor.add_node(node_id, time.time())
        return breaker

    def _failed(self, node: NodeT, exc: WorkerLost) -> None:
        self._breaker(node.id).failed(time.monotonic(), definite=exc.definite)
        log.warning("node failed: %s", exc, extra={"node": node.id})

    # ----- the loops ----------------------------------------------------------------------

    async def _tokenize_anywhere(
        self, request: GenerationRequest, tokenize_on: Callable[[NodeT], Awaitable[list[int]]]
    ) -> list[int]:
        tried: list[str] = []
        while True:
            node = self._pick(request.model, [], request.tenant_id, tried, any_node=True)
            try:
                return await tokenize_on(node)
            except WorkerLost as exc:
                self._failed(node, exc)
                tried.append(node.id)
                if len(tried) >= self.max_attempts:
                    raise EngineDeadError(f"tokenizing failed on {len(tried)} {self.nodes_noun}: {exc}") from exc
            except WorkerRefused as exc:
                if exc.kind not in RETRY_ELSEWHERE:
                    raise driver_error(exc, request.model) from exc
                tried.append(node.id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        prompt = request.tokenized_prompt
        if prompt is None:
            prompt = await self.tokenize(request)
        card = self._card(request.model)
        budget = request.max_tokens if request.max_tokens is not None else card.max_model_len - len(prompt)
        if budget < 1:
            raise InvalidRequestError(
                f"This model's maximum context length is {card.max_model_len} tokens; the prompt has {len(prompt)}",
                param="max_tokens")
        sent: list[int] = []  # token ids the client has: what a resumed attempt continues from
        tried: list[str] = []
        last_failure = ""
        refused: WorkerRefused | None = None
        while True:
            try:
                node = self._pick(request.model, prompt, request.tenant_id, tried)
            except EngineDeadError as exc:
                if refused is not None and not sent:
                    raise driver_error(refused, request.model) from exc  # every node said no: say why
                raise EngineDeadError(f"{exc}; last failure: {last_failure}" if last_failure else str(exc)) from exc
            # A fresh id per attempt: a node that still holds an earlier attempt never sees a duplicate.
            rid = request.request_id if not tried else f"{request.request_id}.{len(tried)}"
            self.router.in_flight[node.id] = self.router.in_flight.get(node.id, 0) + 1
            tally = self.tallies.setdefault(node.id, WorkerTally())
            tally.requests += 1
            arrival = time.time()
            got_token = False
            try:
                attempt = self._attempt(node, request, rid, prompt, sent, budget)
                async with contextlib.aclosing(attempt) as chunks:  # closed at once when our client goes
                    async for chunk in chunks:
                        if not got_token and chunk.token_ids:
                            got_token = True
                            self._breaker(node.id).succeeded()
                            now = time.time()
                            self.monitor.record_ttft(node.id, now, now - arrival, len(prompt))
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
                raise WorkerLost(f"{node.id}: the stream ended before the request finished")
            except WorkerLost as exc:
                self._failed(node, exc)
                tally.errors += 1
                tried.append(node.id)
                last_failure = str(exc)
                if len(tried) >= self.max_attempts:
                    raise EngineDeadError(
                        f"the request failed on {len(tried)} {self.nodes_noun}; last: {exc}") from exc
                self.failovers += 1
                tally.failovers += 1
                log.warning("failover after %d tokens", len(sent),
                            extra={"request_id": request.request_id, "node": node.id, "error": str(exc)})
            except WorkerRefused as exc:
                self._breaker(node.id).succeeded()  # it answered: alive
                if exc.kind not in RETRY_ELSEWHERE:
                    raise driver_error(exc, request.model) from exc
                tried.append(node.id)
                refused = exc
            finally:
                self.router.in_flight[node.id] -= 1


def driver_error(exc: WorkerRefused, model: str) -> DriverError:
    """The one mapping of a node's refusal to the driver seam's errors."""
    retry = exc.retry_after if exc.retry_after is not None else 1.0
    if exc.kind is ErrorKind.INVALID:
        return InvalidRequestError(str(exc), exc.param)
    if exc.kind is ErrorKind.MODEL_NOT_FOUND:
        return ModelNotFoundError(model)
    if exc.kind is ErrorKind.SHUTTING_DOWN:
        return ShuttingDownError(str(exc), retry_after=retry)
    if exc.kind is ErrorKind.OVERLOADED:
        return OverloadedError(str(exc), retry_after=retry)
    return EngineDeadError(f"refused: {exc}")
