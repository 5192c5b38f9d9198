"""The request-body deadline: a client must send its whole body within `timeout_s` of the request
reaching the app, or the request ends with 408 and the connection is closed.

uvicorn bounds neither how long a request body may take nor the gap between its chunks, so a
client that sends a few bytes of a body and stops would hold its connection and a handler task
forever (a slow-loris). The deadline wraps ASGI `receive`, the one door every body read goes
through: our own `_decode`, Litestar's `JSONBody` parameters and anything added later. Once the
body is complete the wrapper steps aside, so a handler that keeps listening for the client's
disconnect (a generation in flight) is never cut by it.
"""

from __future__ import annotations

import asyncio
import time

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, ReceiveMessage, Scope, Send


class BodyTimeoutError(Exception):
    """The client did not send the whole request body within the deadline (408, connection closed)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The request body did not arrive within {timeout_s:g} s")
        self.timeout_s = timeout_s


class BodyReadDeadline(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def receive_by_deadline() -> ReceiveMessage:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyTimeoutError(self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await next_app(scope, receive_by_deadline, send)
