"""The worker's HTTP face: a plain ASGI app over one hosted `Driver` (native or synthetic).

Plain ASGI rather than Litestar because the one hot route is a stream whose life is tied to its
connection: its pump (worker/stream.py) watches `http.disconnect` itself and aborts the request in the engine
the moment the gateway closes the stream (failover, client gone), and it interleaves keepalive
lines so a hung worker is told apart from a slow one (drivers/fleet/wire.py).

    GET  /healthz /readyz /metrics          open (no prompts, only load figures)
    GET  /fleet/v1/info, /fleet/v1/tokenizer  fleet secret
    POST /fleet/v1/tokenize, /generate      fleet secret

Every refusal is a JSON `ErrorBody` with a 4xx / 503 status; nothing a client sends makes a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from drivers.base import (
    Driver,
    DriverError,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ShuttingDownError,
)
from drivers.fleet import wire
from drivers.fleet.prefixes import PrefixLedger
from drivers.fleet.wire import ErrorBody, ErrorKind, WorkerInfo, WorkerLoad, WorkerState
from drivers.portable_tokenizer import TokenizerSpec, fingerprint
from observability.tracing import RequestTracer
from worker.settings import WorkerSettings
from worker.stream import TokenStream

log = logging.getLogger("sluice.worker")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.MODEL_NOT_FOUND: 404,
    ErrorKind.FENCED: 409,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.SHUTTING_DOWN: 503,
    ErrorKind.ENGINE_DEAD: 503,
}
_SUBMIT = msgspec.json.Decoder(wire.SubmitRequest)
_TOKENIZE = msgspec.json.Decoder(wire.TokenizeRequest)


class Refused(Exception):
    """A request refused with an ErrorBody (mapped to its status by `_STATUS`)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.body = ErrorBody(kind=kind, message=message, param=param, retry_after=retry_after)


def refusal(exc: DriverError) -> Refused:
    """The one mapping of the driver seam's errors to the wire's."""
    if isinstance(exc, InvalidRequestError):
        return Refused(ErrorKind.INVALID, str(exc), exc.param)
    if isinstance(exc, ModelNotFoundError):
        return Refused(ErrorKind.MODEL_NOT_FOUND, str(exc), "model")
    if isinstance(exc, ShuttingDownError):
        return Refused(ErrorKind.SHUTTING_DOWN, str(exc), retry_after=exc.retry_after)
    if isinstance(exc, OverloadedError):
        return Refused(ErrorKind.OVERLOADED, str(exc), retry_after=exc.retry_after)
    return Refused(ErrorKind.ENGINE_DEAD, str(exc))


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("sluice_worker_requests", "Generate streams by how they ended", ["outcome"],
                                registry=self.registry)
        self.tokens = Counter("sluice_worker_tokens", "Tokens streamed to gateways", registry=self.registry)
        self.frames = Counter("sluice_worker_frames", "Token frames streamed (several tokens each under load)",
                              registry=self.registry)
        self.in_flight = Gauge("sluice_worker_in_flight", "Generate streams open", registry=self.registry)


class WorkerApp:
    def __init__(self, settings: WorkerSettings, driver: Driver) -> None:
        self.settings = settings
        self.driver = driver
        self.state = WorkerState.JOINING
        self.incarnation = 0  # set by the registration (Redis) before the app serves
        self.in_flight = 0
        self.metrics = WorkerMetrics()
        # One span per generate, child of the gateway's (its traceparent header); None: tracing off.
        self.tracer = RequestTracer.create(settings.otlp_endpoint, settings.service_name)
        self._secret = settings.fleet_secret.encode() if settings.fleet_secret else None
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_state: list[Callable[[], None]] = []  # told of every state change (the heartbeat)
        self._start_task: asyncio.Task[None] | None = None
        self._started_at = time.time()
        # The prefixes the gateways' requests came with, as many as the KV pool can keep (in every heartbeat).
        self.prefixes = PrefixLedger()
        # Model id -> its tokenizer spec and fingerprint: hashing a large tokenizer's MBs once, not per heartbeat.
        self._fingerprints: dict[str, tuple[TokenizerSpec, str]] = {}

    # ----- lifecycle -------------------------------------------------------------------

    def on_state_change(self, callback: Callable[[], None]) -> None:
        self._on_state.append(callback)

    def set_state(self, state: WorkerState) -> None:
        if state is not self.state:
            log.warning("worker %s", state, extra={"worker": self.settings.worker_id})
            self.state = state
            for callback in self._on_state:
                callback()

    async def start(self) -> None:
        """Load the engine; READY once it serves (unless a drain began meanwhile)."""
        await self.driver.start()
        if self.state is WorkerState.JOINING:
            self.set_state(WorkerState.READY)

    async def drain(self, timeout_s: float) -> bool:
        """DRAINING (routers stop sending at their next look), then wait for the open streams to end."""
        self.set_state(WorkerState.DRAINING)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def load(self) -> WorkerLoad:
        h = await self.driver.health()
        return WorkerLoad(
            running=h.running, waiting=h.waiting, in_flight=self.in_flight,
            kv_blocks_used=h.kv_blocks_used, kv_blocks_total=h.kv_blocks_total,
            max_num_seqs=h.max_num_seqs, max_waiting=h.max_waiting,
            generation_tokens_per_s=h.generation_tokens_per_s, prompt_tokens_per_s=h.prompt_tokens_per_s,
            prefix_cache_hit_rate=h.prefix_cache_hit_rate,
        )

    async def info(self) -> WorkerInfo:
        s = self.settings
        load = await self.load()
        return WorkerInfo(
            id=s.worker_id, address=s.address, state=self.state, incarnation=self.incarnation,
            models=self.driver.models() if self.state is not WorkerState.JOINING else [],
            load=load, heartbeat_at=time.time(), host=s.host,
            tokenizers=self._tokenizer_fingerprints() if self.state is not WorkerState.JOINING else {},
            prefixes=self.prefixes.held(load.kv_blocks_total),
        )

    def _tokenizer_fingerprints(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for card in self.driver.models():
            spec = self.driver.tokenizer_spec(card.id)
            if spec is None:
                continue
            known = self._fingerprints.get(card.id)
            if known is None or known[0] is not spec:  # drivers keep their spec: identity means unchanged
                known = self._fingerprints[card.id] = (spec, fingerprint(spec))
            out[card.id] = known[1]
        return out

    def _tokenizer(self, scope: Scope) -> bytes:
        model = parse_qs(scope.get("query_string", b"").decode()).get("model", [""])[0]
        spec = self.driver.tokenizer_spec(model) if self.state is WorkerState.READY else None
        if spec is None:
            raise Refused(ErrorKind.MODEL_NOT_FOUND, f"no portable tokenizer of model {model!r} here", "model")
        return msgspec.json.encode(spec)

    # ----- ASGI ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        try:
            if route == ("GET", "/healthz"):
                health = await self.driver.health()
                await _json(send, 200 if health.live else 503, {"live": health.live, "detail": health.detail})
            elif route == ("GET", "/readyz"):
                ready = self.state is WorkerState.READY and (await self.driver.health()).ready
                await _json(send, 200 if ready else 503, {"ready": ready, "state": str(self.state)})
            elif route == ("GET", "/metrics"):
                await _respond(send, 200, generate_latest(self.metrics.registry), b"text/plain; version=0.0.4")
            elif route == ("GET", wire.INFO_PATH):
                self._authenticate(scope)
                await _respond(send, 200, msgspec.json.encode(await self.info()))
            elif route == ("GET", wire.TOKENIZER_PATH):
                self._authenticate(scope)
                await _respond(send, 200, self._tokenizer(scope))
            elif route == ("POST", wire.TOKENIZE_PATH):
                self._authenticate(scope)
                await self._tokenize(await self._body(receive), send)
            elif route == ("POST", wire.GENERATE_PATH):
                self._authenticate(scope)
                await self._generate(await self._body(receive), receive, send, _header(scope, b"traceparent"))
            else:
                await _json(send, 404, {"kind": "not_found", "message": f"no route {scope['method']} {scope['path']}"})
        except Refused as exc:
            await _respond(send, _STATUS[exc.body.kind], msgspec.json.encode(exc.body))
        except _BodyTooLarge:
            await _json(send, 413, {"kind": "invalid", "message": "request body too large"})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # The worker listens while its model loads: /healthz answers, /readyz says 503 (JOINING).
                self._start_task = asyncio.create_task(self._start_or_die(), name="sluice-worker-start")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._start_task is not None and not self._start_task.done():
                    self._start_task.cancel()
                await self.driver.stop()
                if self.tracer is not None:
                    self.tracer.shutdown()  # flushes the spans still batched
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start_or_die(self) -> None:
        try:
            await self.start()
        except Exception:
            log.exception("the hosted driver failed to start")
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)

    def _authenticate(self, scope: Scope) -> None:
        if self._secret is None:
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
        # Constant time: the comparison must not tell an attacker how many leading bytes were right.
        if not hmac.compare_digest(given, self._secret):
            raise Refused(ErrorKind.UNAUTHORIZED, "missing or wrong fleet secret")

    async def _body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(ErrorKind.INVALID, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _tokenize(self, body: bytes, send: Send) -> None:
        req = _decode(_TOKENIZE, body)
        if sum(x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)) != 1:
            raise Refused(ErrorKind.INVALID, "exactly one of prompt, prompt_token_ids, messages", "prompt")
        try:
            ids = await self.driver.tokenize(GenerationRequest(
                request_id="tokenize", model=req.model, prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids, messages=req.messages,
            ))
        except DriverError as exc:
            raise refusal(exc) from exc
        await _respond(send, 200, msgspec.json.encode(wire.TokenizeResponse(ids)))

    def _generation_request(self, sub: wire.SubmitRequest) -> GenerationRequest:
        if self.state is not WorkerState.READY:
            kind = ErrorKind.SHUTTING_DOWN if self.state is WorkerState.DRAINING else ErrorKind.OVERLOADED
            raise Refused(kind, f"worker {self.settings.worker_id} is {self.state}", retry_after=1.0)
        if sub.incarnation is not None and sub.incarnation != self.incarnation:
            raise Refused(ErrorKind.FENCED, f"this is incarnation {self.incarnation}, not {sub.incarnation}")
        if not sub.prompt_token_ids:
            raise Refused(ErrorKind.INVALID, "prompt_token_ids is empty", "prompt_token_ids")
        if sub.sampling.max_tokens < 1:
            raise Refused(ErrorKind.INVALID, "max_tokens must be at least 1", "max_tokens")
        if not 0 <= sub.resumed_tokens < len(sub.prompt_token_ids):
            raise Refused(ErrorKind.INVALID, "resumed_tokens must be below the prompt's length", "resumed_tokens")
        if sub.deadline is not None and time.time() > sub.deadline:
            raise Refused(ErrorKind.OVERLOADED, "the request's deadline has passed")
        s = sub.sampling
        return GenerationRequest(
            request_id=sub.request_id, model=sub.model, prompt_token_ids=sub.prompt_token_ids,
            tokenized_prompt=sub.prompt_token_ids, resumed_output_tokens=sub.resumed_tokens,
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, seed=s.seed, stop=s.stop, stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos, logprobs=s.logprobs, logit_bias=s.logit_bias, priority=sub.priority,
            tenant_id=sub.tenant_id,
            tenant_weight=sub.tenant_weight,
        )

    async def _generate(self, body: bytes, receive: Receive, send: Send, trace_parent: str | None) -> None:
        started = time.time()
        sub = _decode(_SUBMIT, body)
        request = self._generation_request(sub)
        if sub.prefix_key is not None:
            self.prefixes.record(sub.prefix_key, len(sub.prompt_token_ids))
        pump: TokenStream | None = None
        self.in_flight += 1
        self.metrics.in_flight.inc()
        self._idle.clear()
        outcome = "refused"
        stream = aiter(self.driver.generate(request))
        first = asyncio.ensure_future(_next(stream))
        try:
            # The status waits for the first chunk (up to one keepalive period): a refusal before any
            # output (bad ids, queue full) is a proper 4xx / 503; after that it is a FailureEvent line.
            await asyncio.wait({first}, timeout=self.settings.keepalive_s)
            if first.done() and isinstance(first.exception(), DriverError):
                raise refusal(first.exception())  # type: ignore[arg-type]
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
            pump = TokenStream(first, stream, send, receive, lambda exc: refusal(exc).body, deadline=sub.deadline,
                               keepalive_s=self.settings.keepalive_s, interval_s=self.settings.stream_interval_s)
            try:
                outcome = await pump.run()
            finally:
                self.metrics.tokens.inc(pump.tokens_sent)
                self.metrics.frames.inc(pump.frames_sent)
        finally:
            if not first.done():
                first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            # However this ended (finished, refused, gateway gone), close the driver's stream: closing
            # it aborts the request in the engine.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(DriverError):
                    await aclose()
            self.metrics.requests.labels(outcome).inc()
            if self.tracer is not None:
                self._trace(sub, trace_parent, started, outcome, pump.tokens_sent if pump else 0)
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            if self.in_flight == 0:
                self._idle.set()


    def _trace(self, sub: wire.SubmitRequest, trace_parent: str | None, started: float, outcome: str,
               tokens: int) -> None:
        assert self.tracer is not None
        self.tracer.record_remote("sluice.worker.generate", trace_parent, started, time.time(), {
            "sluice.node.id": self.settings.worker_id,
            "sluice.worker.incarnation": self.incarnation,
            "sluice.request.id": sub.request_id,
            "sluice.worker.outcome": outcome,
            "sluice.resumed_tokens": sub.resumed_tokens,
            "gen_ai.request.model": sub.model,
            "gen_ai.usage.input_tokens": len(sub.prompt_token_ids),
            "gen_ai.usage.output_tokens": tokens,
        }, error=None if outcome == "finished" else outcome)


class _BodyTooLarge(Exception):
    pass


async def _next(it: AsyncIterator[GenerationChunk]) -> GenerationChunk | None:
    return await anext(it, None)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise Refused(ErrorKind.INVALID, f"invalid request body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise Refused(ErrorKind.INVALID, f"request body is not valid JSON: {exc}") from exc


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    await _respond(send, status, msgspec.json.encode(payload))
