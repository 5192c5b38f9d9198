"""One request's stream from one worker, over httpx, with the timeouts that tell a hung worker
from a slow one.

    connect_s      the TCP (and TLS) connection must be up by then: a dead host or port
    stall_s        no byte at all for this long: the worker is hung (SIGSTOP) or cut off; a live
                   worker sends a keepalive line every 0.5 s even while a request waits
    first_token_s  the first token must come by then, keepalives or not (an engine that accepts
                   work and never runs it)
    inter_token_s  the same between two tokens

Each failure is a `WorkerLost` (try another worker) or a `WorkerRefused` (the worker answered
no, with an `ErrorKind` that says whether another worker may say yes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import httpx
import msgspec

from drivers.fleet import wire
from drivers.fleet.timeouts import FleetTimeouts
from drivers.fleet.wire import ErrorKind
from drivers.portable_tokenizer import SPEC_DECODER, TokenizerSpec

TOKENIZER_FETCH_S = 30.0


class WorkerLost(Exception):
    """The worker is unreachable, hung, or its stream broke: retry elsewhere."""

    def __init__(self, message: str, definite: bool = False) -> None:
        super().__init__(message)
        self.definite = definite  # certainly down now (connection refused): open its circuit at once


class WorkerRefused(Exception):
    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.param, self.retry_after = kind, param, retry_after


class TokenClock:
    """Reads a response's bytes within the first-token deadline, then within the inter-token one
    from each token on (`token_came`); bytes without a token (keepalives) move no deadline."""

    def __init__(self, raw: AsyncIterator[bytes], address: str, timeouts: FleetTimeouts) -> None:
        self._raw, self._address, self._timeouts = raw, address, timeouts
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + timeouts.first_token_s

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout_at(self._due):
                return await anext(self._raw)
        except StopAsyncIteration:
            raise WorkerLost(f"{self._address}: the stream ended before the request finished") from None
        except TimeoutError:
            raise WorkerLost(f"{self._address}: no token within the token timeout") from None

    def token_came(self) -> None:
        self._due = self._loop.time() + self._timeouts.inter_token_s


def lost(exc: Exception, address: str, timeouts: FleetTimeouts) -> WorkerLost:
    """The one reading of a transport failure: what it says about the node."""
    if isinstance(exc, httpx.ConnectError):
        return WorkerLost(f"cannot connect to {address}: {exc}", definite=True)
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return WorkerLost(f"{address}: no connection within {timeouts.connect_s} s ({type(exc).__name__})")
    if isinstance(exc, httpx.TimeoutException):
        return WorkerLost(f"{address}: silent for {timeouts.stall_s} s ({type(exc).__name__})")
    return WorkerLost(f"{address}: {type(exc).__name__} {exc}")


# What `lost` reads: transport failures, and bodies that are not the protocol's.
TRANSPORT_ERRORS = (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError)


class WorkerClient:
    def __init__(self, secret: str | None, timeouts: FleetTimeouts, verify: bool | str = True) -> None:
        self.timeouts = timeouts
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        t = timeouts
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(connect=t.connect_s, read=t.stall_s, write=t.stall_s, pool=t.connect_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            verify=verify,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def tokenize(self, address: str, request: wire.TokenizeRequest) -> list[int]:
        try:
            response = await self.http.post(address + wire.TOKENIZE_PATH, content=msgspec.json.encode(request))
        except httpx.HTTPError as exc:
            raise lost(exc, address, self.timeouts) from exc
        if response.status_code != 200:
            raise _refusal(response.status_code, response.content, address)
        return msgspec.json.decode(response.content, type=wire.TokenizeResponse).token_ids

    async def tokenizer(self, address: str, model: str) -> TokenizerSpec:
        """The worker's prompt tokenizer of `model` (a large one is MBs: no stall timeout applies)."""
        try:
            response = await self.http.get(address + wire.TOKENIZER_PATH, params={"model": model},
                                           timeout=httpx.Timeout(TOKENIZER_FETCH_S, connect=self.timeouts.connect_s))
        except httpx.HTTPError as exc:
            raise lost(exc, address, self.timeouts) from exc
        if response.status_code != 200:
            raise _refusal(response.status_code, response.content, address)
        try:
            return SPEC_DECODER.decode(response.content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise lost(exc, address, self.timeouts) from exc

    async def stream(
        self, address: str, request: wire.SubmitRequest, headers: dict[str, str] | None = None
    ) -> AsyncGenerator[wire.TokensEvent, None]:
        """The request's token events up to the one with `finish_reason`; closing it early closes the
        connection, which aborts the request on the worker."""
        body = msgspec.json.encode(request)
        try:
            async with self.http.stream("POST", address + wire.GENERATE_PATH, content=body, headers=headers) as response:
                if response.status_code != 200:
                    raise _refusal(response.status_code, await response.aread(), address)
                # A read holds one frame or several (a frame holds every token the worker had ready):
                # all complete lines of it are decoded by msgspec in one call, straight from bytes.
                clock = TokenClock(response.aiter_raw(), address, self.timeouts)
                buffer = b""
                while True:
                    buffer += await clock.read()
                    end = buffer.rfind(b"\n") + 1
                    if not end:
                        continue
                    events, buffer = wire.STREAM_DECODER.decode_lines(buffer[:end]), buffer[end:]
                    for event in events:
                        if isinstance(event, wire.KeepAlive):
                            continue
                        if isinstance(event, wire.FailureEvent):
                            raise WorkerRefused(event.kind, event.message, retry_after=event.retry_after)
                        yield event
                        if event.finish_reason is not None:
                            return
                        if event.token_ids:
                            clock.token_came()
        except TRANSPORT_ERRORS as exc:
            raise lost(exc, address, self.timeouts) from exc


def _refusal(status: int, content: bytes, address: str) -> Exception:
    try:
        body = wire.ERROR_DECODER.decode(content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return WorkerLost(f"{address}: HTTP {status} without an error body")
    return WorkerRefused(body.kind, body.message, body.param, body.retry_after)
