"""The native driver's engine nodes: which one gets a request, how each is doing, fault injection.

`NodeRouter` feeds every token's timing into an `observability.node_health.NodeHealthMonitor`,
evaluates it once per interval (logging each transition as a structured line), routes new
requests to healthy nodes first, and reports nodes for `GET /admin/nodes`. A flagged node still
gets an occasional probe request when it is idle, or it could never show that it recovered.
It listens to the `drivers.supervisor.EngineSupervisor`: a dead node is marked at once with its
restart plan, a restarted one starts over as healthy with an empty window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from drivers.base import InvalidRequestError, NodeEvent, NodeInfo, NodesReport, milliseconds
from engine_native.client import AsyncEngineClient
from engine_native.messages import RequestOutput
from observability.node_health import NodeHealthConfig, NodeHealthMonitor, NodeStatus

log = logging.getLogger("sluice.nodes")

PROBE_EVERY = 8  # every 8th pick may go to an idle sluggish node, so it can prove it recovered
_RANK = {NodeStatus.HEALTHY: 0, NodeStatus.SLUGGISH: 1, NodeStatus.STALLED: 2, NodeStatus.DEAD: 3}


class RequestTimer:
    """Turns one request's outputs into TTFT / ITL samples of its node."""

    __slots__ = ("_arrival", "_engine", "_last", "_prompt_tokens", "_router")

    def __init__(
        self, router: NodeRouter, engine: AsyncEngineClient, arrival: float, prompt_tokens: int
    ) -> None:
        self._router, self._engine = router, engine
        self._arrival, self._prompt_tokens = arrival, prompt_tokens
        self._last: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        if not out.new_token_ids:
            return
        monitor, node = self._router.monitor, self._engine.config.node_id
        if self._last is None:
            monitor.record_ttft(node, out.token_time, out.token_time - self._arrival, self._prompt_tokens)
        else:
            stats = self._engine.stats
            batch = stats.running if stats is not None else 1
            monitor.record_itl(node, out.token_time, out.token_time - self._last, batch)
        self._last = out.token_time


class NodeRouter:
    def __init__(
        self,
        engines: Sequence[AsyncEngineClient],
        config: NodeHealthConfig | None = None,
        fault_step_delay: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engines = list(engines)
        self.monitor = NodeHealthMonitor([e.config.node_id for e in self.engines], config)
        self.clock = clock  # time.time(): token timestamps from the engine are wall-clock readings
        self.restarts = {e.config.node_id: 0 for e in self.engines}
        self._initial_faults = dict(fault_step_delay or {})
        self._picks = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for node, delay in self._initial_faults.items():
            await self.set_fault(node, delay, False)
        self._task = asyncio.create_task(self._watch(), name="sluice-node-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def pick(self, alive: list[AsyncEngineClient]) -> AsyncEngineClient:
        """Healthy nodes first, least loaded among them; a full healthy node overflows to the rest."""
        self._picks += 1
        status = {e.config.node_id: self.monitor.status(e.config.node_id) for e in alive}
        if self._picks % PROBE_EVERY == 0:
            idle = [e for e in alive if status[e.config.node_id] is NodeStatus.SLUGGISH and not e.num_in_flight]
            if idle:
                return idle[0]
        ranked = sorted(alive, key=lambda e: (_RANK[status[e.config.node_id]], e.num_in_flight))
        for e in ranked:
            if e.num_in_flight < e.config.scheduler.max_num_seqs:
                return e
        return min(alive, key=lambda e: e.num_in_flight)

    def timer(self, engine: AsyncEngineClient, arrival: float, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, engine, arrival, prompt_tokens)

    # ----- the supervisor's transitions (drivers.supervisor.SupervisorListener) ---------

    def engine_died(self, node: str, reason: str, restart_in_s: float | None) -> None:
        plan = f"restarting in {restart_in_s:.1f} s" if restart_in_s is not None else "crash loop: given up"
        self.monitor.mark_dead(node, f"engine dead: {reason}; {plan}", self.clock())

    def engine_restarted(self, node: str) -> None:
        self.restarts[node] += 1
        self.monitor.mark_restarted(node, self.clock())

    async def set_fault(self, node_id: str, step_delay_s: float, stall: bool) -> None:
        engine = self._engine(node_id)
        if step_delay_s < 0:
            raise InvalidRequestError("step_delay_s must be >= 0", param="step_delay_s")
        engine.set_fault(step_delay_s, stall)
        log.warning("fault injected", extra={"node": node_id, "step_delay_s": step_delay_s, "stall": stall})

    def report(self) -> NodesReport:
        views = {a.node: a for a in self.monitor.assessments()}
        nodes = []
        for e in self.engines:
            a, s = views[e.config.node_id], e.stats
            nodes.append(NodeInfo(
                id=e.config.node_id,
                status=str(a.status),
                running=s.running if s else 0,
                waiting=s.waiting if s else 0,
                kv_blocks_used=s.kv_blocks_used if s else 0,
                kv_blocks_total=s.kv_blocks_total if s else 0,
                tokens_per_s=round(s.generation_tokens_per_s, 2) if s else 0.0,
                itl_p50_ms=milliseconds(a.itl_p50_s),
                itl_p99_ms=milliseconds(a.itl_p99_s),
                ttft_p50_ms=milliseconds(a.ttft_p50_s),
                reason=a.reason,
                since=a.since,
                preemptions=s.num_preemptions if s else 0,
                prefix_cache_hit_rate=s.prefix_cache_hit_rate if s else 0.0,
                score=round(a.score, 3) if a.score is not None else None,
                step_delay_s=e.fault[0],
                stalled_by_fault=e.fault[1],
                restarts=self.restarts[e.config.node_id],
                forward_seconds=s.forward_s_total if s else 0.0,
                collective_seconds=s.collective_s_total if s else 0.0,
                device=e.info.device if e.info else None,
                attention_backend=e.info.attention_backend if e.info else None,
            ))
        events = [NodeEvent(ev.time, ev.node, str(ev.kind), ev.reason) for ev in self.monitor.events]
        return NodesReport(nodes, events)

    def _engine(self, node_id: str) -> AsyncEngineClient:
        for e in self.engines:
            if e.config.node_id == node_id:
                return e
        raise InvalidRequestError(f"no node {node_id!r}; nodes: {[e.config.node_id for e in self.engines]}")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.monitor.config.eval_interval_s)
            self.evaluate(self.clock())

    def evaluate(self, now: float) -> None:
        for e in self.engines:
            node = e.config.node_id
            if not e.alive:
                if self.monitor.status(node) is not NodeStatus.DEAD:  # the supervisor's word is richer
                    self.monitor.mark_dead(node, f"engine dead: {e.dead_reason or 'exited'}", now)
                continue
            if e.last_output_at:
                self.monitor.record_progress(node, e.last_output_at)
            self.monitor.set_in_flight(node, e.num_in_flight, now)
        for event in self.monitor.evaluate(now):
            log.warning(
                "node %s", event.kind, extra={"node": event.node, "event": str(event.kind), "reason": event.reason}
            )

