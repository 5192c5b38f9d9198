"""Autoscaling signals: what an autoscaler reads from this gateway, refreshed when it is read.

`ScalingMonitor.refresh()` reads the driver's health and nodes, the shedder's queue-wait estimate for
each tier and the requests held for a first worker (gateway/cold_start.py), and computes the
desired-workers figure (scaling/desired.py, where the formula is documented). /metrics and
`GET /admin/nodes` refresh it before they answer, so nothing polls in between.

Exported (gauges, `ScalingCollector`):

    vllm:num_requests_running{model_name}    running sequences: the names vLLM exports, so tooling
    vllm:num_requests_waiting{model_name}    written for vLLM (the Gateway API inference extension,
    vllm:kv_cache_usage_perc{model_name}     KEDA/HPA recipes, dashboards) reads Sluice unchanged;
                                             waiting counts the engines' queues plus the held requests
    sluice_desired_workers                   the formula's figure
    sluice_ready_workers                     workers (engine nodes) able to serve now
    sluice_scaling_pressure                  the formula's max term (1 = at target; +Inf: no worker)
    sluice_prefill_utilization               prompt tokens/s over the measured prefill capacity
    sluice_estimated_queue_wait_seconds{priority}   the shedder's calibrated estimate, per tier
    sluice_requests_held{priority}           waiting for a first worker (scale from zero)
    sluice_activation                        1 while there is demand and no ready worker
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from drivers.base import Driver, DriverHealth, NodeEvent, NodeInfo, NodesReport
from gateway.cold_start import ColdStartHold
from gateway.load_shedding import LoadShedder
from scaling.desired import Desired, FleetLoad, ScalingPolicy, desired_workers


class ScalingSignal(msgspec.Struct, frozen=True, kw_only=True):
    """The autoscaling figures as `GET /admin/nodes` shows them (`scaling`)."""

    desired_workers: int
    ready_workers: int
    pressure: float | None  # None: no worker is ready (infinite pressure)
    driver: str  # the formula's term that decided: idle, activation, queue_wait, kv_cache, occupancy
    driver_tier: int | None = None
    running: int = 0
    waiting: int = 0  # engines' queues + held at the gateway
    held_by_priority: dict[int, int] = {}
    estimated_wait_s_by_priority: dict[int, float] = {}
    kv_cache_usage: float = 0.0  # 0..1
    prefill_utilization: float | None = None  # prompt tokens/s over measured prefill capacity
    min_workers: int = 0
    max_workers: int = 0


class NodesView(msgspec.Struct, frozen=True):
    """`GET /admin/nodes`: the driver's nodes and events, and the autoscaling signal."""

    nodes: list[NodeInfo]
    events: list[NodeEvent]
    scaling: ScalingSignal


def ready_workers(health: DriverHealth, report: NodesReport) -> int:
    """Workers that can serve now: live nodes when the driver is ready (one if it names none)."""
    if not health.ready:
        return 0
    live = [n for n in report.nodes if n.status != "dead"]
    return len(live) if report.nodes else 1


class ScalingMonitor:
    def __init__(self, driver: Driver, shedder: LoadShedder, hold: ColdStartHold, policy: ScalingPolicy) -> None:
        self.driver = driver
        self.shedder = shedder
        self.hold = hold
        self.policy = policy
        self.latest = ScalingSignal(desired_workers=policy.min_workers, ready_workers=0, pressure=0.0,
                                    driver="idle", min_workers=policy.min_workers,
                                    max_workers=policy.max_workers)

    async def refresh(self) -> ScalingSignal:
        health = await self.driver.health()
        report = self.driver.nodes()
        ready = ready_workers(health, report)
        tiers = range(len(self.policy.ttft_targets_s))
        waits = {}
        if ready:
            for tier in tiers:
                wait = self.shedder.estimate(health, tier).wait_s
                if wait is not None:
                    waits[tier] = wait
        held = dict(self.hold.held)
        load = FleetLoad(
            ready_workers=ready, wait_s_by_tier=waits, running=health.running, waiting=health.waiting,
            held=sum(held.values()), max_num_seqs=health.max_num_seqs, kv_blocks_used=health.kv_blocks_used,
            kv_blocks_total=health.kv_blocks_total,
            prefill_utilization=(health.prompt_tokens_per_s / health.prefill_tokens_per_s
                                 if ready and health.prefill_tokens_per_s > 0 else None),
        )
        self.latest = self._signal(load, desired_workers(load, self.policy), held)
        return self.latest

    def _signal(self, load: FleetLoad, d: Desired, held: dict[int, int]) -> ScalingSignal:
        kv = load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
        return ScalingSignal(
            desired_workers=d.workers, ready_workers=load.ready_workers,
            pressure=None if math.isinf(d.pressure) else round(d.pressure, 4), driver=str(d.driver),
            driver_tier=d.tier, running=load.running, waiting=load.waiting + load.held, held_by_priority=held,
            estimated_wait_s_by_priority={t: round(w, 4) for t, w in load.wait_s_by_tier.items()},
            kv_cache_usage=round(kv, 4),
            prefill_utilization=None if load.prefill_utilization is None else round(load.prefill_utilization, 4),
            min_workers=self.policy.min_workers, max_workers=self.policy.max_workers,
        )

    async def nodes_view(self) -> NodesView:
        signal = await self.refresh()
        report = self.driver.nodes()
        return NodesView(list(report.nodes), list(report.events), signal)


class ScalingCollector(Collector):
    """The gauges of the module docstring, from the monitor's latest refresh."""

    def __init__(self, monitor: ScalingMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.monitor.latest
        models = [card.id for card in self.monitor.driver.models()] or ["none"]

        def per_model(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            for model in models:  # one engine pool serves every model it lists
                family.add_metric([model], value)
            return family

        yield per_model("vllm:num_requests_running", "Requests running in the engines (vLLM's name)", s.running)
        yield per_model("vllm:num_requests_waiting",
                        "Requests waiting: queued in the engines plus held for a first worker (vLLM's name)",
                        s.waiting)
        yield per_model("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1 (vLLM's name)", s.kv_cache_usage)
        yield GaugeMetricFamily("sluice_desired_workers",
                                "Workers that would keep every tier inside its TTFT target (docs/scaling.md)",
                                value=s.desired_workers)
        yield GaugeMetricFamily("sluice_ready_workers", "Workers able to serve now", value=s.ready_workers)
        yield GaugeMetricFamily("sluice_scaling_pressure",
                                "Max term of the desired-workers formula (1 = at target, +Inf = no worker)",
                                value=math.inf if s.pressure is None else s.pressure)
        if s.prefill_utilization is not None:
            yield GaugeMetricFamily("sluice_prefill_utilization",
                                    "Prompt tokens computed per second over the measured prefill capacity",
                                    value=s.prefill_utilization)
        wait = GaugeMetricFamily("sluice_estimated_queue_wait_seconds",
                                 "Admission control's estimated time to first token, by priority tier",
                                 labels=["priority"])
        for tier, w in sorted(s.estimated_wait_s_by_priority.items()):
            wait.add_metric([str(tier)], w)
        yield wait
        held = GaugeMetricFamily("sluice_requests_held", "Requests waiting for a first worker, by priority tier",
                                 labels=["priority"])
        for tier in range(len(self.monitor.policy.ttft_targets_s)):
            held.add_metric([str(tier)], s.held_by_priority.get(tier, 0))
        yield held
        yield GaugeMetricFamily("sluice_activation", "1 while requests wait and no worker is ready",
                                value=float(s.driver == "activation"))
