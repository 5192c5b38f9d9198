"""An SGLang stand-in: a small real HTTP server that speaks SGLang's native protocol, for the driver's
tests on a machine where SGLang cannot run. Run as a script (`python tests/sglang/standin.py --port N`).

What it follows (SGLang's http_server.py, io_struct.py, tokenizer manager output, kv_events.py):
/generate with input_ids or text, sampling_params, stream; SSE "data: <json>" events ending in
"data: [DONE]"; cumulative text/output_ids/logprobs by default, increments with
--incremental-streaming-output; meta_info {id, finish_reason {type, matched, message, status_code},
prompt_tokens, completion_tokens, cached_tokens, output_token_logprobs, output_top_logprobs};
a ValueError-class problem (prompt too long, bad ids) as 200 + data: {"error": {"message"}}; a
malformed body as 400 {"object": "error", ...}; a full queue as an abort with status_code 503;
/abort_request; a closed connection aborts; /health_generate, /v1/models, /get_model_info,
/get_server_info, /get_load, /tokenize; KV events as (topic, seq, msgpack batch) on a ZMQ PUB socket
with a ROUTER replay socket, block hashes chained over pages like recent SGLang.

The "model": characters are tokens (id = code point; id 1 is BOS), and the next token is a function
of the last three, so output is deterministic, and a resumed request continues the same text.
Test-only routes: GET /standin/state, POST /standin/health {"ok": bool}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

import msgspec
import uvicorn

BOS = 1


class Cache:
    """A page-level radix cache that publishes what it stores and evicts."""

    def __init__(self, page_size: int, max_pages: int, publish: Any) -> None:
        self.page_size, self.max_pages, self.publish = page_size, max_pages, publish
        self.pages: OrderedDict[tuple[int | None, tuple[int, ...]], int] = OrderedDict()  # (parent, page) -> hash

    def admit(self, tokens: list[int]) -> int:
        """Insert the prompt's pages; returns the cached prefix length it found."""
        parent: int | None = None
        matched, stored, stored_tokens, first_parent = 0, [], [], None
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            page = tuple(tokens[start: start + self.page_size])
            key = (parent, page)
            block = self.pages.get(key)
            if block is not None and not stored:
                self.pages.move_to_end(key)
                matched += self.page_size
            else:
                if block is None:
                    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
                    block = int.from_bytes(digest, "big", signed=True)
                    self.pages[key] = block
                    if not stored:
                        first_parent = parent
                    stored.append(block)
                    stored_tokens.extend(page)
            parent = block
        if stored:
            self.publish([["BlockStored", stored, first_parent, stored_tokens, self.page_size, None]])
        removed = []
        while len(self.pages) > self.max_pages:
            _, block = self.pages.popitem(last=False)
            removed.append(block)
        if removed:
            self.publish([["BlockRemoved", removed]])
        return matched

    def clear(self) -> None:
        self.pages.clear()
        self.publish([["AllBlocksCleared"]])


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.healthy = True
        self.aborted: list[str] = []
        self.seen: list[dict[str, Any]] = []  # every /generate body, for the tests
        self.running = 0
        self.waiting = 0
        self.slot = asyncio.Condition()
        self.abort_flags: dict[str, asyncio.Event] = {}
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.pub: Any = None
        self.cache = Cache(args.page_size, args.max_cached_pages, self._publish)

    # -- KV events ---------------------------------------------------------------------------------
    async def start_events(self) -> None:
        if not self.args.kv_events:
            return
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(self.args.kv_events)
        if self.args.kv_replay:
            router = ctx.socket(zmq.ROUTER)
            router.bind(self.args.kv_replay)
            asyncio.get_running_loop().create_task(self._serve_replay(router))

    def _publish(self, events: list[list[Any]]) -> None:
        if self.pub is None:
            return
        payload = msgspec.msgpack.encode([time.time(), events])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self, router: Any) -> None:
        while True:
            client, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    # -- the "model" -------------------------------------------------------------------------------
    @staticmethod
    def next_token(context: list[int]) -> int:
        if len(context) % 6 == 5:
            return 32
        return 97 + (sum(context[-3:]) * 7 + len(context)) % 26

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(t) for t in ids if t >= 32)

    # -- ASGI --------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self.start_events()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if self.args.api_key and dict(scope["headers"]).get(b"authorization") != f"Bearer {self.args.api_key}".encode():
            return await _json(send, 401, {"error": {"message": "Unauthorized"}})
        body = b""
        if method in ("POST", "PUT"):
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        a = self.args
        if path in ("/health", "/health_generate"):
            return await _json(send, 200 if self.healthy else 503, None)
        if path == "/v1/models":
            return await _json(send, 200, {"object": "list", "data": [
                {"id": a.model, "object": "model", "created": 0, "owned_by": "sglang", "root": a.model,
                 "max_model_len": a.context_length}]})
        if path == "/get_model_info":
            return await _json(send, 200, {"model_path": a.model, "tokenizer_path": a.model, "is_generation": True,
                                           "preferred_sampling_params": None, "weight_version": "default"})
        if path == "/get_server_info":
            return await _json(send, 200, {
                "model_path": a.model, "served_model_name": a.model, "context_length": a.context_length,
                "incremental_streaming_output": a.incremental_streaming_output, "page_size": a.page_size,
                "max_total_num_tokens": 100_000, "internal_states": [{}], "version": "standin"})
        if path == "/get_load" and not a.no_get_load:
            return await _json(send, 200, [{"dp_rank": 0, "num_reqs": self.running,
                                            "num_waiting_reqs": self.waiting, "num_tokens": 0}])
        if path == "/metrics" and a.enable_metrics:
            return await _text(send, 200, self.metrics())
        if path == "/tokenize":
            req = json.loads(body)
            tokens = ([BOS] if req.get("add_special_tokens", True) else []) + [ord(c) for c in req["prompt"]]
            return await _json(send, 200, {"tokens": tokens, "count": len(tokens), "max_model_len": a.context_length})
        if path == "/abort_request":
            rid = json.loads(body).get("rid")
            if rid:
                self.aborted.append(rid)
                if rid in self.abort_flags:
                    self.abort_flags[rid].set()
            return await _json(send, 200, None)
        if path == "/flush_cache":
            self.cache.clear()
            return await _json(send, 200, None)
        if path == "/standin/state":
            return await _json(send, 200, {"aborted": self.aborted, "seen": self.seen, "running": self.running})
        if path == "/standin/health":
            self.healthy = bool(json.loads(body)["ok"])
            return await _json(send, 200, None)
        if path == "/generate":
            return await self.generate(body, receive, send)
        return await _json(send, 404, {"detail": "Not Found"})

    def metrics(self) -> str:
        """SGLang's Prometheus exposition (--enable-metrics) for the gauges a router reads, labelled as
        SGLang labels them, with a counter and a histogram line around them as in the real output."""
        labels = f'{{model_name="{self.args.model}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
        usage = len(self.cache.pages) / self.args.max_cached_pages
        return "".join([
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n",
            "# TYPE sglang:prompt_tokens_total counter\n",
            f"sglang:prompt_tokens_total{labels} {float(len(self.seen))}\n",
            "# HELP sglang:num_running_reqs The number of running requests.\n",
            "# TYPE sglang:num_running_reqs gauge\n",
            f"sglang:num_running_reqs{labels} {float(self.running)}\n",
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n",
            "# TYPE sglang:num_queue_reqs gauge\n",
            f"sglang:num_queue_reqs{labels} {float(self.waiting)}\n",
            "# HELP sglang:token_usage The token usage.\n",
            "# TYPE sglang:token_usage gauge\n",
            f"sglang:token_usage{labels} {usage}\n",
            f'sglang:time_to_first_token_seconds_bucket{{le="0.1",{labels[1:]} 0.0\n',
        ])

    async def generate(self, raw: bytes, receive: Any, send: Any) -> None:
        try:
            req = json.loads(raw)
            params = req.get("sampling_params") or {}
            if "input_ids" in req:
                prompt = [int(t) for t in req["input_ids"]]
            else:
                prompt = [ord(c) for c in req["text"]]
        except (ValueError, KeyError, TypeError) as exc:
            return await _json(send, 400, {"object": "error", "message": f"invalid request: {exc}",
                                           "type": "Bad Request", "param": None, "code": 400})
        self.seen.append(req)
        rid = str(req.get("rid") or f"standin-{len(self.seen)}")
        problem = None
        if len(prompt) >= self.args.context_length:
            problem = (f"The input ({len(prompt)} tokens) is longer than the model's context length "
                       f"({self.args.context_length} tokens).")
        elif any(t < 0 for t in prompt):
            problem = "Input ids must be non-negative."
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if problem is not None:
            await _event(send, {"error": {"message": problem}})
            return await _done(send)
        aborted = self.abort_flags[rid] = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not aborted.is_set():
                self.aborted.append(rid)
                aborted.set()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._run(req, params, rid, prompt, send, aborted)
        finally:
            watcher.cancel()
            self.abort_flags.pop(rid, None)

    async def _run(self, req: dict[str, Any], params: dict[str, Any], rid: str, prompt: list[int], send: Any,
                   aborted: asyncio.Event) -> None:
        a = self.args
        meta: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": len(prompt),
                                "completion_tokens": 0, "cached_tokens": 0}
        if self.running >= a.max_running_requests:
            if self.waiting >= a.max_queued_requests:
                meta["finish_reason"] = {"type": "abort", "status_code": 503, "message": "The request queue is full."}
                await _event(send, {"text": "", "output_ids": [], "meta_info": meta})
                return await _done(send)
            self.waiting += 1
            async with self.slot:
                await self.slot.wait_for(lambda: self.running < a.max_running_requests)
            self.waiting -= 1
        self.running += 1
        try:
            meta["cached_tokens"] = self.cache.admit(prompt)
            max_new = int(params.get("max_new_tokens", 16))
            stops = [s for s in params.get("stop") or [] if s]
            stop_ids = set(params.get("stop_token_ids") or [])
            want_lp = bool(req.get("return_logprob"))
            top_n = int(req.get("top_logprobs_num") or 0)
            incremental = a.incremental_streaming_output
            out: list[int] = []
            lps: list[list[Any]] = []
            tops: list[list[list[Any]]] = []
            text = ""
            sent_ids = sent_lp = sent_text = 0
            await asyncio.sleep(a.ttft_ms / 1000)
            while True:
                if aborted.is_set():  # the closing event SGLang sends an aborted request (lost if it is gone)
                    meta = {**meta, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
                    await _event(send, {"text": "" if incremental else text, "output_ids": [], "meta_info": meta})
                    return await _done(send)
                token = self.next_token(prompt + out)
                out.append(token)
                lp = -0.05 - 0.1 * (len(out) % 5)
                lps.append([lp, token, chr(token)])
                alts = [[lp, token, chr(token)]] + [[lp - 1.0 - k, 97 + (token + k + 1) % 26, chr(97 + (token + k + 1) % 26)]
                                                    for k in range(max(0, top_n - 1))]
                tops.append(alts[:top_n])
                finish = None
                if token in stop_ids:
                    finish = {"type": "stop", "matched": token}
                else:
                    text += chr(token)
                    hit = next((s for s in stops if s in text[-(len(s) + 1):]), None)
                    if hit is not None:
                        text = text[: text.rfind(hit)]
                        finish = {"type": "stop", "matched": hit}
                if finish is None and len(out) >= max_new:
                    finish = {"type": "length", "length": len(out)}
                meta = {**meta, "completion_tokens": len(out), "finish_reason": finish}
                if want_lp:
                    meta["output_token_logprobs"] = lps[sent_lp:] if incremental else list(lps)
                    meta["output_top_logprobs"] = tops[sent_lp:] if incremental else list(tops)
                if finish is not None:
                    meta["e2e_latency"] = 0.0
                if incremental:
                    event = {"text": text[sent_text:], "output_ids": out[sent_ids:], "meta_info": meta}
                else:
                    event = {"text": text, "output_ids": list(out), "meta_info": meta}
                sent_ids, sent_lp, sent_text = len(out), len(lps), len(text)
                await _event(send, event)
                if finish is not None:
                    return await _done(send)
                await asyncio.sleep(a.token_delay_ms / 1000)
        finally:
            self.running -= 1
            async with self.slot:
                self.slot.notify_all()


async def _json(send: Any, status: int, payload: Any) -> None:
    body = b"" if payload is None else json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def _text(send: Any, status: int, text: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
    await send({"type": "http.response.body", "body": text.encode()})


async def _event(send: Any, payload: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(payload).encode() + b"\n\n",
                "more_body": True})


async def _done(send: Any) -> None:
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="standin")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--token-delay-ms", type=float, default=2.0)
    p.add_argument("--ttft-ms", type=float, default=2.0)
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--max-cached-pages", type=int, default=10_000)
    p.add_argument("--max-running-requests", type=int, default=1000)
    p.add_argument("--max-queued-requests", type=int, default=1000)
    p.add_argument("--kv-events", default=None, help="PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-replay", default=None, help="ROUTER replay endpoint")
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-metrics", action="store_true", help="serve /metrics (Prometheus text), as SGLang does")
    p.add_argument("--no-get-load", action="store_true", help="404 on /get_load, as servers without it do")
    args = p.parse_args()
    uvicorn.run(StandIn(args), host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
