"""A stand-in for Stripe's billing meter API (v1), as Stripe documents it, for the official SDK to talk to.

    POST /v1/billing/meter_events             validation (400 naming the param), identifier unique over
                                              24 h ("An event already exists with identifier ..."),
                                              timestamps within the past 35 days / 5 min ahead
    POST /v1/billing/meter_event_adjustments  type=cancel, cancel[identifier]: only within 24 h
    GET  /v1/billing/meters                   the meters it was made with (sum aggregation)
    GET  /v1/billing/meters/{id}/event_summaries   customer, minute-aligned start_time/end_time
    Idempotency-Key                           the first executed answer is stored and replayed
                                              (Idempotent-Replayed: true), errors included; other
                                              parameters -> 400 idempotency_error; same key while the
                                              first is still running -> 409; validation failures,
                                              429s and pre-execution 500s are not stored

Faults are queued by the test (`inject`) and consumed by the next matching POSTs:
    "429", "500"            answered before executing (nothing counted, nothing stored)
    "timeout"               sleeps `delay_s` (longer than the client waits), then executes normally
    "slow"                  the same with a `delay_s` the client does wait for: a slow 200
    "commit_then_500"       executes and counts the event, answers 500 (stored for the key)
    "commit_then_hold"      executes, counts, stores the 200, then holds the answer until released

Unlike Stripe, summaries are up to date at once (Stripe aggregates asynchronously), and customer
mapping is not checked (Stripe reports it asynchronously too).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import uvicorn

from tests.polling import wait_until

DAY = 86_400


@dataclass
class Fault:
    kind: str
    delay_s: float = 0.0


@dataclass
class MeterEvent:
    identifier: str
    event_name: str
    customer: str
    value: float
    timestamp: int
    created: float
    cancelled: bool = False


@dataclass
class StoredAnswer:
    fingerprint: str
    status: int
    body: bytes
    done: bool = True


class StripeStandIn:
    def __init__(self, meters: dict[str, str]) -> None:
        """`meters`: event_name -> meter id."""
        self.meters = dict(meters)
        self.events: dict[str, MeterEvent] = {}
        self.executions: Counter[str] = Counter()  # identifier -> times a create executed with it
        self.duplicates: Counter[str] = Counter()  # identifier -> duplicate refusals
        self.replays = 0
        self.requests: Counter[str] = Counter()  # "POST /v1/..." -> count
        self.faults: list[Fault] = []
        self.held = threading.Event()  # set while a commit_then_hold answer waits
        self.release = threading.Event()
        self.keys: dict[str, StoredAnswer] = {}
        self.lock = threading.Lock()
        self.clock = time.time

    # -- what tests read ---------------------------------------------------------------------------------

    def inject(self, *kinds: str, delay_s: float = 0.0) -> None:
        with self.lock:
            self.faults.extend(Fault(k, delay_s) for k in kinds)

    def total(self, event_name: str, customer: str) -> float:
        with self.lock:
            return sum(
                e.value for e in self.events.values()
                if e.event_name == event_name and e.customer == customer and not e.cancelled
            )

    # -- ASGI ----------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        query = dict(parse_qsl(scope["query_string"].decode()))
        params = dict(parse_qsl(body.decode())) if method == "POST" else query
        status, answer, extra = await self._handle(method, path, params, headers)
        out = [(b"content-type", b"application/json"), (b"request-id", b"req_standin")]
        out += [(k.encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": answer})

    async def _handle(
        self, method: str, path: str, params: dict[str, str], headers: dict[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        self.requests[f"{method} {path}"] += 1
        if not headers.get("authorization", "").startswith("Bearer sk_"):
            return _error(401, "invalid_request_error", "You did not provide an API key.")
        if method == "GET" and path == "/v1/billing/meters":
            return _ok({"object": "list", "url": path, "has_more": False,
                        "data": [self._meter(n, i) for n, i in self.meters.items()]})
        if method == "GET" and path.startswith("/v1/billing/meters/") and path.endswith("/event_summaries"):
            return self._summaries(path.split("/")[4], params)
        if method != "POST" or path not in ("/v1/billing/meter_events", "/v1/billing/meter_event_adjustments"):
            return _error(404, "invalid_request_error", f"Unrecognized request URL ({method}: {path}).")
        fault = self._next_fault()
        if fault and fault.kind == "429":
            return _error(429, "invalid_request_error", "Request rate limit exceeded.", code="rate_limit")
        if fault and fault.kind == "500":
            return _error(500, "api_error", "An unknown error occurred.")
        key = headers.get("idempotency-key")
        fingerprint = hashlib.sha256(f"{path}?{sorted(params.items())}".encode()).hexdigest()
        if key:
            with self.lock:
                stored = self.keys.get(key)
                if stored is not None and stored.fingerprint != fingerprint:
                    return _error(400, "idempotency_error",
                                  "Keys for idempotent requests can only be used with the same parameters "
                                  f"they were first used with. Try using a key other than '{key}' if you "
                                  "meant to execute a different request.")
                if stored is not None and not stored.done:
                    return _error(409, "idempotency_error",
                                  "There is currently another in-progress request using this Idempotent "
                                  f"Key (that probably means you submitted twice, and the other request is "
                                  f"still going through): {key}. Please try again later.")
                if stored is not None:
                    self.replays += 1
                    return stored.status, stored.body, {"idempotent-replayed": "true",
                                                        "idempotency-key": key}
                self.keys[key] = StoredAnswer(fingerprint, 0, b"", done=False)
        try:
            if fault and fault.kind in ("timeout", "slow"):  # the key is taken meanwhile: a retry gets 409
                await asyncio.sleep(fault.delay_s)
            status, answer, extra = self._execute(path, params)
        except BaseException:
            if key:
                self.keys.pop(key, None)
            raise
        if fault and fault.kind == "commit_then_500" and status == 200:
            status, answer, extra = _error(500, "api_error", "An unknown error occurred.")
        stored_answer = status < 400 or status >= 500 or extra.get("stripe-should-retry") == "false"
        if key:
            with self.lock:
                if stored_answer:  # executed: stored, error or not; validation failures are not
                    self.keys[key] = StoredAnswer(fingerprint, status, answer)
                else:
                    del self.keys[key]
        if fault and fault.kind == "commit_then_hold":
            self.held.set()
            while not self.release.is_set():
                await asyncio.sleep(0.02)
        return status, answer, extra

    def _next_fault(self) -> Fault | None:
        with self.lock:
            return self.faults.pop(0) if self.faults else None

    # -- endpoints -----------------------------------------------------------------------------------

    def _execute(self, path: str, params: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        if path == "/v1/billing/meter_events":
            return self._create_event(params)
        return self._adjust(params)

    def _create_event(self, p: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        name = p.get("event_name")
        if not name:
            return _missing("event_name")
        if len(name) > 100:
            return _invalid("event_name", "Invalid string: must be at most 100 characters.")
        if "payload[stripe_customer_id]" not in p:
            return _missing("payload[stripe_customer_id]")
        if "payload[value]" not in p:
            return _missing("payload[value]")
        try:
            value = float(p["payload[value]"])
        except ValueError:
            return _invalid("payload[value]", "The value must be a number.")
        now = self.clock()
        timestamp = int(p.get("timestamp", now))
        if timestamp < now - 35 * DAY or timestamp > now + 300:
            return _invalid("timestamp", "Timestamp must be within the past 35 calendar days or up to 5 "
                            "minutes in the future.")
        identifier = p.get("identifier") or f"auto_{len(self.events)}_{now}"
        if len(identifier) > 100:
            return _invalid("identifier", "Invalid string: must be at most 100 characters.")
        with self.lock:
            self.executions[identifier] += 1
            earlier = self.events.get(identifier)
            if earlier is not None and now - earlier.created < DAY:
                self.duplicates[identifier] += 1
                status, body, _ = _invalid(
                    "identifier", f"An event already exists with identifier {identifier}."
                )
                return status, body, {"stripe-should-retry": "false"}
            self.events[identifier] = MeterEvent(identifier, name, p["payload[stripe_customer_id]"], value,
                                                 timestamp, now)
        return _ok({"object": "billing.meter_event", "created": int(now), "event_name": name,
                    "identifier": identifier, "livemode": False, "timestamp": timestamp,
                    "payload": {"stripe_customer_id": p["payload[stripe_customer_id]"],
                                "value": p["payload[value]"]}})

    def _adjust(self, p: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        if not p.get("event_name"):
            return _missing("event_name")
        if p.get("type") != "cancel":
            return _missing("type") if "type" not in p else _invalid("type", "Invalid type: must be cancel.")
        identifier = p.get("cancel[identifier]")
        if not identifier:
            return _missing("cancel[identifier]")
        with self.lock:
            event = self.events.get(identifier)
            if event is None or event.event_name != p["event_name"]:
                return _invalid("cancel[identifier]", f"No meter event with identifier {identifier}.")
            if self.clock() - event.created > DAY:
                return _invalid("cancel[identifier]", "Meter events can only be cancelled within 24 hours.")
            event.cancelled = True
        return _ok({"object": "billing.meter_event_adjustment", "livemode": False, "status": "pending",
                    "event_name": p["event_name"], "type": "cancel", "cancel": {"identifier": identifier}})

    def _summaries(self, meter_id: str, q: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        names = [n for n, i in self.meters.items() if i == meter_id]
        if not names:
            return _error(404, "invalid_request_error", f"No such billing meter: '{meter_id}'",
                          param="id", code="resource_missing")
        for required in ("customer", "start_time", "end_time"):
            if required not in q:
                return _missing(required)
        start, end = int(q["start_time"]), int(q["end_time"])
        for param, value in (("start_time", start), ("end_time", end)):
            if value % 60:
                return _invalid(param, f"{param} must be aligned with minute boundaries.")
        if start >= end:
            return _invalid("start_time", "start_time must be before end_time.")
        with self.lock:
            value = sum(
                e.value for e in self.events.values()
                if e.event_name == names[0] and e.customer == q["customer"] and not e.cancelled
                and start <= e.timestamp < end
            )
        summary = {"id": f"mtrusg_{meter_id}_{start}", "object": "billing.meter_event_summary",
                   "aggregated_value": value, "start_time": start, "end_time": end,
                   "livemode": False, "meter": meter_id}
        return _ok({"object": "list", "url": f"/v1/billing/meters/{meter_id}/event_summaries",
                    "has_more": False, "data": [summary]})

    def _meter(self, name: str, meter_id: str) -> dict[str, Any]:
        return {"id": meter_id, "object": "billing.meter", "created": 1700000000, "display_name": name,
                "event_name": name, "event_time_window": None, "livemode": False, "status": "active",
                "customer_mapping": {"event_payload_key": "stripe_customer_id", "type": "by_id"},
                "default_aggregation": {"formula": "sum"},
                "value_settings": {"event_payload_key": "value"},
                "status_transitions": {"deactivated_at": None}, "updated": 1700000000}


def _ok(obj: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
    return 200, json.dumps(obj).encode(), {}


def _error(status: int, kind: str, message: str, param: str | None = None,
           code: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if param:
        error["param"] = param
    if code:
        error["code"] = code
    return status, json.dumps({"error": error}).encode(), {}


def _missing(param: str) -> tuple[int, bytes, dict[str, str]]:
    return _error(400, "invalid_request_error", f"Missing required param: {param}.", param, "parameter_missing")


def _invalid(param: str, message: str) -> tuple[int, bytes, dict[str, str]]:
    return _error(400, "invalid_request_error", message, param, "parameter_invalid")


@dataclass
class RunningStandIn:
    app: StripeStandIn
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str = field(default="")

    def stop(self) -> None:
        self.app.release.set()
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(app: StripeStandIn) -> RunningStandIn:
    """Run the stand-in on a free port in a thread of this process."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the stand-in to start", interval_s=0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningStandIn(app, server, thread, f"http://127.0.0.1:{port}")
