"""What the gateway knows of each SGLang server, from polling it.

    once (and again after it was down: it may have been replaced)
        GET /v1/models        served model name, context length
        GET /get_server_info  --incremental-streaming-output, page size, version (optional: older
                              servers lack fields, the defaults hold)
    every poll_s
        GET /health_generate  200: up (SGLang ran, or saw, a one-token generation); else down
        GET /get_load         running / waiting requests, for routing and /readyz's figures;
                              a server without it (404): GET /metrics (--enable-metrics) for
                              sglang:num_running_reqs / num_queue_reqs / token_usage; with
                              neither, the router counts only the streams it sent there

A poll that fails (refused, timed out, malformed) is the server's state, never an error of ours:
the node turns down with the reason, and routing leaves it out until a poll says up again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx

from drivers.sglang import protocol
from drivers.sglang.client import ServerLoad, SGLangClient, parse_load, parse_metrics
from drivers.sglang.router import ServerNode

log = logging.getLogger("sluice.sglang")


async def poll_server(client: SGLangClient, node: ServerNode, poll_s: float, timeout_s: float) -> None:
    while True:
        try:
            if node.model is None or node.stale:
                await read_facts(client, node, timeout_s)
            if await client.healthy(node.address, timeout_s):
                node.running, node.waiting, node.kv_usage = await read_load(client, node, timeout_s)
                if not node.up and node.last_ok:
                    node.restarts += 1
                node.up, node.last_ok, node.detail = True, time.monotonic(), ""
            else:
                node.up, node.detail = False, "/health_generate is not 200"
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            if node.up:
                log.warning("sglang server down: %s", exc, extra={"node": node.id})
            node.up, node.detail, node.stale = False, f"{type(exc).__name__}: {exc}", True
        await asyncio.sleep(poll_s)


LOAD_SOURCES = (protocol.LOAD_PATH, protocol.METRICS_PATH)


async def read_load(client: SGLangClient, node: ServerNode, timeout_s: float) -> ServerLoad:
    """The server's load from the first source it offers, remembered in `node.load_source` (probed
    again when its facts are: a replaced server may offer another). A source it lacks (404, or a
    /metrics without SGLang's gauges) moves on to the next; other failures are the server's state
    and reach the caller."""
    sources = LOAD_SOURCES if node.load_source is None else (node.load_source,)
    for path in sources:
        try:
            if path == protocol.LOAD_PATH:
                load = parse_load(await client.get_json(node.address, path, timeout_s))
            else:
                load = parse_metrics((await client.get(node.address, path, timeout_s)).text)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 404:
                raise
            continue
        except ValueError:
            if path == protocol.LOAD_PATH:
                raise  # a /get_load that is not JSON: broken, not absent
            continue
        if node.load_source != path:
            log.info("sglang server load from %s", path, extra={"node": node.id})
        node.load_source = path
        return load
    if node.load_source != "":
        log.warning("sglang server offers neither /get_load nor SGLang's /metrics: routing counts only "
                    "the streams this gateway sent there", extra={"node": node.id})
    node.load_source = ""
    return ServerLoad(0, 0)


async def read_facts(client: SGLangClient, node: ServerNode, timeout_s: float) -> None:
    models = await client.get_json(node.address, protocol.MODELS_PATH, timeout_s)
    card = models["data"][0]
    server: dict[str, Any] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError):  # older servers: the defaults below hold
        server = await client.get_json(node.address, protocol.SERVER_INFO_PATH, timeout_s)
    node.incremental = bool(server.get("incremental_streaming_output") or server.get("stream_output"))
    node.max_model_len = int(card.get("max_model_len") or server.get("context_length") or 0)
    node.extra = {k: server[k] for k in ("version", "page_size", "max_total_num_tokens") if k in server}
    node.model, node.stale, node.load_source = str(card["id"]), False, None
