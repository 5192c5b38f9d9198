"""One SGLang server's endpoints over httpx, and one request's stream with the timeouts that tell a
dead server from a slow one.

    connect_s      the TCP (and TLS) connection must be up by then: a dead host or port
    first_token_s  the first output must come by then (SGLang sends nothing while a request queues)
    inter_token_s  the same between two outputs

Each failure is a `WorkerLost` (try another server) or a `WorkerRefused` (the server answered no,
with an `ErrorKind` that says whether another server may say yes), the fleet's two exceptions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncGenerator
from typing import Any, NamedTuple

import httpx
import msgspec

from drivers.fleet.client import TRANSPORT_ERRORS, TokenClock, WorkerLost, WorkerRefused, lost
from drivers.fleet.timeouts import FleetTimeouts
from drivers.fleet.wire import ErrorKind
from drivers.sglang import protocol
from drivers.sglang.protocol import GenerateOut

ABORT_TIMEOUT_S = 2.0


class SGLangClient:
    def __init__(self, api_key: str | None, timeouts: FleetTimeouts) -> None:
        self.timeouts = timeouts
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        t = timeouts
        # No read timeout on the socket: a queued request is silent; the token timeouts below bound it.
        self.http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(connect=t.connect_s, read=None, write=10.0, pool=t.connect_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def get(self, address: str, path: str, timeout_s: float) -> httpx.Response:
        """A GET that raises httpx.HTTPStatusError on an error status; the caller reads .json() or .text."""
        response = await self.http.get(address + path, timeout=timeout_s)
        response.raise_for_status()
        return response

    async def get_json(self, address: str, path: str, timeout_s: float) -> Any:
        return (await self.get(address, path, timeout_s)).json()

    async def healthy(self, address: str, timeout_s: float) -> bool:
        """/health_generate: 200 once a one-token generation went through (or the server is busy
        generating anyway); 503 while it starts, drains or is unhealthy."""
        response = await self.http.get(address + protocol.HEALTH_PATH, timeout=timeout_s)
        return response.status_code == 200

    async def tokenize(self, address: str, text: str, add_special_tokens: bool) -> list[int]:
        try:
            response = await self.http.post(address + protocol.TOKENIZE_PATH,
                                            json={"prompt": text, "add_special_tokens": add_special_tokens})
        except httpx.HTTPError as exc:
            raise lost(exc, address, self.timeouts) from exc
        if response.status_code != 200:
            raise refusal(response.status_code, response.content, response.headers, address)
        tokens = response.json().get("tokens")
        if not isinstance(tokens, list):
            raise WorkerLost(f"{address}: /tokenize answered without tokens")
        return [int(t) for t in tokens]

    async def abort(self, address: str, rid: str) -> None:
        """Best effort: closing the stream already aborts on SGLang; this covers a proxy in between
        that keeps the upstream connection open."""
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(address + protocol.ABORT_PATH, json={"rid": rid}, timeout=ABORT_TIMEOUT_S)

    async def stream(self, address: str, body: dict[str, Any]) -> AsyncGenerator[GenerateOut, None]:
        """The request's outputs up to the one with a finish reason; closing it early closes the
        connection, which aborts the request on the server."""
        try:
            async with self.http.stream("POST", address + protocol.GENERATE_PATH, json=body) as response:
                if response.status_code != 200:
                    raise refusal(response.status_code, await response.aread(), response.headers, address)
                clock = TokenClock(response.aiter_raw(), address, self.timeouts)
                buffer = b""
                while True:
                    buffer += await clock.read()
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        data = _sse_data(event)
                        if data is None:
                            continue
                        if data == protocol.DONE:
                            raise WorkerLost(f"{address}: [DONE] before a finish reason")
                        out = protocol.OUT_DECODER.decode(data)
                        if out.error is not None:
                            # SGLang's ValueError path: a request it cannot serve (too long, bad ids).
                            raise WorkerRefused(ErrorKind.INVALID, out.error.message)
                        yield out
                        if out.meta_info.finish_reason is not None:
                            return
                        clock.token_came()
        except TRANSPORT_ERRORS as exc:
            raise lost(exc, address, self.timeouts) from exc


def _sse_data(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


def refusal(status: int, content: bytes, headers: httpx.Headers, address: str) -> Exception:
    """The one mapping of an SGLang HTTP status to a refusal (or a lost server)."""
    try:
        message = protocol.ERROR_DECODER.decode(content).text()
    except (msgspec.DecodeError, msgspec.ValidationError):
        message = content[:200].decode(errors="replace")
    message = message or f"HTTP {status}"
    if status in (400, 413, 422):
        return WorkerRefused(ErrorKind.INVALID, message)
    if status == 404:
        return WorkerRefused(ErrorKind.MODEL_NOT_FOUND, message)
    if status in (429, 503):
        return WorkerRefused(ErrorKind.OVERLOADED, message, retry_after=_retry_after(headers))
    if status in (401, 403):
        return WorkerRefused(ErrorKind.ENGINE_DEAD, f"{address} refused the API key ({status})")
    return WorkerLost(f"{address}: HTTP {status}: {message}")


def _retry_after(headers: httpx.Headers) -> float | None:
    with contextlib.suppress(TypeError, ValueError):
        return float(headers.get("retry-after"))
    return None


class ServerLoad(NamedTuple):
    running: int
    waiting: int
    kv_usage: float | None = None  # fraction of the KV pool in use; /get_load does not say


def parse_load(payload: Any) -> ServerLoad:
    """(running, waiting) from /get_load: a list of per-DP-rank {"num_reqs", "num_waiting_reqs", ...}
    or, in older servers, {"load": N}."""
    ranks = payload if isinstance(payload, list) else [payload]
    running = waiting = 0
    for rank in ranks:
        if not isinstance(rank, dict):
            continue
        running += int(rank.get("num_reqs", rank.get("load", 0)) or 0)
        waiting += int(rank.get("num_waiting_reqs", 0) or 0)
    return ServerLoad(running, waiting)


_GAUGES = {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting", "sglang:token_usage": "kv"}


def parse_metrics(text: str) -> ServerLoad:
    """The load gauges from SGLang's Prometheus text (/metrics, --enable-metrics): requests summed over
    the samples (one per DP rank or label set), KV usage the fullest sample's. Lines that are not one
    of these gauges, or not a number, are skipped. ValueError when none of the request gauges is there:
    a /metrics that is not SGLang's says nothing about load."""
    found: dict[str, list[float]] = {"running": [], "waiting": [], "kv": []}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        which = _GAUGES.get(name)
        if which is None:
            continue
        rest = line.rsplit("}", 1)[1] if "{" in line else line[len(name):]  # value [timestamp]
        with contextlib.suppress(ValueError, IndexError):
            value = float(rest.split()[0])
            if math.isfinite(value):
                found[which].append(value)
    if not found["running"] and not found["waiting"]:
        raise ValueError("/metrics has no sglang:num_running_reqs or sglang:num_queue_reqs")
    kv = max(found["kv"]) if found["kv"] else None
    return ServerLoad(int(sum(found["running"])), int(sum(found["waiting"])), kv)
