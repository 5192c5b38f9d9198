"""Engine nodes for operators: `GET /admin/nodes` (status, window figures, events) and fault
injection for chaos testing, `POST /admin/nodes/{id}/fault`. Admin key when auth is on; open on a
--no-auth dev server, like everything else there."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Request, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody
from msgspec import Meta

from drivers.base import Driver
from gateway.auth import ADMIN_SECURITY, provide_admin
from gateway.openapi import error_responses
from gateway.scaling import NodesView, ScalingMonitor
from observability.hub import Observability
from observability.length_view import LengthLatencyReport


class FaultIn(msgspec.Struct, forbid_unknown_fields=True):
    step_delay_s: Annotated[float, Meta(ge=0.0, le=60.0)] = 0.0  # extra sleep after every engine step; 0 clears it
    stall: bool = False  # stop stepping, keep requests: the watchdog's case


class FaultOut(msgspec.Struct):
    node: str
    step_delay_s: float
    stall: bool


async def provide_node_admin(request: Request) -> None:
    if request.app.state.get("tenancy") is not None:
        await provide_admin(request)


@get("/admin/nodes", security=ADMIN_SECURITY, tags=["admin"], responses=error_responses(401, 403))
async def list_nodes(scaling: NamedDependency[ScalingMonitor], node_admin: NamedDependency[None]) -> NodesView:
    """Every engine node: status (healthy, sluggish, stalled, dead), load, latency over the health
    window, why it is flagged; the latest flag/unflag events; and the autoscaling signal (`scaling`:
    desired workers and what decided it, docs/scaling.md)."""
    return await scaling.nodes_view()


@post(
    "/admin/nodes/{node_id:str}/fault",
    status_code=200,
    security=ADMIN_SECURITY,
    tags=["admin"],
    responses=error_responses(400, 401, 403, 408, 413),
)
async def set_fault(
    node_id: FromPath[str], data: JSONBody[FaultIn], driver: NamedDependency[Driver],
    node_admin: NamedDependency[None],
) -> FaultOut:
    """Chaos testing: an extra delay per engine step on one node, or a stall; zeros clear it."""
    await driver.set_fault(node_id, data.step_delay_s, data.stall)
    return FaultOut(node_id, data.step_delay_s, data.stall)


@get("/admin/latency/by-length", security=ADMIN_SECURITY, tags=["admin"], responses=error_responses(401, 403))
async def latency_by_length(
    observability: NamedDependency[Observability], node_admin: NamedDependency[None]
) -> LengthLatencyReport:
    """TTFT and inter-token latency per minute of the last hour, by prompt-length bucket, and
    inter-token latency by output position (p50 / p90 / count): the console's Latency tab."""
    return observability.by_length.report()


NODE_ROUTES = [list_nodes, set_fault, latency_by_length]
NODE_DEPENDENCIES = {"node_admin": Provide(provide_node_admin)}
