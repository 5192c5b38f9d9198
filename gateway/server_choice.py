"""The event loop and HTTP parser uvicorn runs the gateway and the workers on: one choice for both.

uvloop (libuv) for asyncio's selector loop and httptools (llhttp, C) for h11 (pure Python): the same ASGI
app, each streamed token's wake-up, timer and chunked write costing less of the core the engine shares.
Named rather than uvicorn's "auto", which falls back to asyncio and h11 without a word when either is
missing; both are dependencies, so a server that cannot have them fails at start instead.

Measured (docs/engine.md, "What bounds 32 streams on the EPYC", 2026-12-05): the gateway's CPU per streamed
token with the synthetic driver, 512 requests of 128 tokens at 128 streams from vLLM's client, 151 and 140 µs
on asyncio + h11 against 108 and 104 here.
"""

from __future__ import annotations

from typing import Final

SERVER_LOOP: Final = "uvloop"
SERVER_HTTP: Final = "httptools"
