"""`sluice bench version-switch`: what switching a model's version costs the traffic, and how long the
replicas take to follow the admin.

Two `sluice serve --driver native` replicas share a PostgreSQL database (a fresh one, dropped after)
and Redis. Model `bench` has two versions, tiny random Llamas written as Hugging Face folders
(benchmarks/version_models.py; `--v1`/`--v2` take other sources). A client in a process of its own
keeps `streams` streaming chat requests in flight, alternating replicas, while this process, as the
admin, switches the alias v1 -> v2, then rolls it back, `steady_s` apart, and polls every replica for
the moment it applied each generation (the replica's own clock: one host).

Prints TTFT p50 / p99 and throughput (requests/s, tokens/s) of the requests sent within `window_s`
after each admin call ("switching") vs all the others ("steady"), and per switch the time from the
admin's call to the last replica routing by the new generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server_process import ServerProcess
from benchmarks.sse_lines import sse_lines

ADMIN_KEY = "version-switch-bench-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}", "x-sluice-actor": "bench"}
MODEL = "bench"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class SwitchBenchConfig:
    streams: int = 32  # requests in flight, half on each replica
    max_tokens: int = 8
    steady_s: float = 8.0  # traffic before, between and after the two switches
    window_s: float = 2.0  # requests sent this long after an admin call count as "switching"
    pg_url: str = "postgresql://postgres@127.0.0.1:5432/test"  # the server; a fresh database is made on it
    redis_url: str = "redis://127.0.0.1:6379/0"
    v1: str | None = None  # sources; None: tiny random Llamas
    v2: str | None = None
    dtype: str = "float32"


@dataclass(frozen=True)
class Record:
    replica: int
    sent: float
    first: float | None  # time.time() of the first content
    ended: float
    ok: bool
    tokens: int
    model: str | None
    generation: int | None


# ----- the client, in a process of its own -----------------------------------------------------


def _client(urls: list[str], key: str, config: SwitchBenchConfig, stop_at: float, out: str) -> None:
    records = asyncio.run(_load(urls, key, config, stop_at))
    Path(out).write_text(json.dumps([asdict(r) for r in records]))


async def _load(urls: list[str], key: str, config: SwitchBenchConfig, stop_at: float) -> list[Record]:
    records: list[Record] = []
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": config.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    # Idle connections expire before the server's keep-alive timeout (5 s): none is reused as it closes.
    limits = httpx.Limits(max_connections=config.streams, keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker(i: int) -> None:
            replica = i % len(urls)
            while time.time() < stop_at:
                records.append(await _stream(client, urls[replica], replica, key, body))

        await asyncio.gather(*(worker(i) for i in range(config.streams)))
    return records


async def _stream(client: httpx.AsyncClient, url: str, replica: int, key: str, body: dict[str, Any]) -> Record:
    sent, first, tokens, model, generation, done = time.time(), None, 0, None, None, False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as resp:
            if "x-sluice-model-generation" in resp.headers:
                generation = int(resp.headers["x-sluice-model-generation"])
            async for line in sse_lines(resp):
                if line == "data: [DONE]":
                    done = resp.status_code == 200
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    model = chunk.get("model", model)
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                        first = time.time()
    except httpx.HTTPError:
        done = False
    return Record(replica, sent, first, time.time(), done, tokens, model, generation)


# ----- the admin -----------------------------------------------------------------------------------


def _admin(url: str, method: str, path: str, **body: Any) -> Any:
    resp = httpx.request(method, f"{url}{path}", headers=ADMIN, json=body or None, timeout=300)
    if resp.status_code >= 300:
        raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text}")
    return resp.json()


def _applied_at(urls: list[str], generation: int, timeout_s: float = 60.0) -> list[float]:
    """Per replica, when it started routing by `generation` (its `applied_at`)."""
    found: dict[int, float] = {}
    give_up = time.monotonic() + timeout_s
    while len(found) < len(urls):
        if time.monotonic() > give_up:
            raise RuntimeError(f"generation {generation} not applied everywhere after {timeout_s:.0f} s")
        for i, url in enumerate(urls):
            applied = _admin(url, "GET", f"/admin/models/{MODEL}")["applied"]
            if i not in found and applied and applied["generation"] == generation:
                found[i] = applied["applied_at"]
        time.sleep(0.01)
    return [found[i] for i in range(len(urls))]


def _setup(urls: list[str], sources: dict[str, str], dtype: str) -> str:
    for version in ("v1", "v2"):
        _admin(urls[0], "POST", f"/admin/models/{MODEL}/versions", version=version, source=sources[version],
               dtype=dtype)
        _admin(urls[0], "POST", f"/admin/models/{MODEL}/versions/{version}/deploy")
        if version == "v1":
            _admin(urls[0], "PUT", f"/admin/models/{MODEL}/alias", weights={"v1": 100}, generation=0)
    give_up = time.monotonic() + 300
    while not all(v["hosted_here"] for u in urls for v in _admin(u, "GET", f"/admin/models/{MODEL}")["versions"]):
        if time.monotonic() > give_up:
            raise RuntimeError("v2 not hosted on every replica after 300 s")
        time.sleep(0.1)
    _applied_at(urls, 1)
    tenant = _admin(urls[0], "POST", "/admin/tenants", name=f"bench-{uuid.uuid4().hex[:6]}", requests_per_minute=None,
                    tokens_per_minute=None, max_concurrent=None)
    return str(_admin(urls[0], "POST", f"/admin/tenants/{tenant['id']}/keys", name="bench")["key"])


# ----- figures ---------------------------------------------------------------------------------------


def _summary(records: list[Record], span: float) -> dict[str, Any]:
    """`span`: the seconds of sending time these records were sent in (throughput = sent / span)."""
    ttfts = sorted(r.first - r.sent for r in records if r.first is not None)
    if not records or not ttfts:
        return {"requests": len(records)}

    def pct(q: float) -> float:
        return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000, 1)

    return {"requests": len(records), "failed": sum(not r.ok for r in records), "ttft_p50_ms": pct(0.5),
            "ttft_p99_ms": pct(0.99), "requests_per_s": round(len(records) / span, 1),
            "tokens_per_s": round(sum(r.tokens for r in records) / span, 1)}


def run(config: SwitchBenchConfig) -> dict[str, Any]:
    from benchmarks.version_models import tiny_llama
    from tenants.db import create_postgres_database, drop_postgres_database

    folder = Path(tempfile.mkdtemp(prefix="sluice-version-switch-"))
    sources = {"v1": config.v1 or str(tiny_llama(folder, seed=1)), "v2": config.v2 or str(tiny_llama(folder, seed=2))}
    db_url = f"{config.pg_url.rsplit('/', 1)[0]}/sluice_bench_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_postgres_database(db_url))
    env = {"DATABASE_URL": db_url, "REDIS_URL": config.redis_url, "SLUICE_ADMIN_KEY": ADMIN_KEY,
           "SLUICE_REGISTRY_REFRESH_S": "600"}  # a generation reaching a replica came through Redis
    options = ["--driver", "native", "--model", sources["v1"], "--dtype", config.dtype, "--max-model-len", "256",
               "--kv-cache-memory", str(16 * 2**20), "--num-threads", "1", "--max-num-seqs", str(config.streams)]
    try:
        with ServerProcess(options, 600, auth=True, env=env) as a, ServerProcess(options, 600, auth=True, env=env) as b:
            urls = [a.base_url, b.base_url]
            key = _setup(urls, sources, config.dtype)
            out = str(folder / "records.json")
            stop_at = time.time() + 3 * config.steady_s
            client = multiprocessing.get_context("spawn").Process(target=_client, args=(urls, key, config, stop_at, out))
            client.start()
            switches: list[dict[str, Any]] = []
            called_at: list[float] = []
            for generation, call in ((2, ("PUT", "alias", {"weights": {"v2": 100}, "generation": 1})),
                                     (3, ("POST", "rollback", {"generation": 2}))):
                time.sleep(config.steady_s)
                called = time.time()
                called_at.append(called)
                _admin(urls[0], call[0], f"/admin/models/{MODEL}/{call[1]}", **call[2])
                answered = time.time()
                applied = _applied_at(urls, generation)
                switches.append({"generation": generation,
                                 "admin_call_ms": round((answered - called) * 1000, 1),
                                 "last_replica_applied_ms": round((max(applied) - called) * 1000, 1),
                                 "per_replica_applied_ms": [round((t - called) * 1000, 1) for t in applied]})
            client.join(3 * config.steady_s + 300)
            records = [Record(**r) for r in json.loads(Path(out).read_text())]
    finally:
        asyncio.run(drop_postgres_database(db_url))
    start = min(r.sent for r in records) + 1.0  # the first second warms the connections
    end = max(r.sent for r in records)

    def switching(r: Record) -> bool:
        return any(c <= r.sent <= c + config.window_s for c in called_at)

    measured = [r for r in records if r.sent >= start]
    switching_s = sum(min(c + config.window_s, end) - c for c in called_at)
    return {
        "config": asdict(config),
        "switching": _summary([r for r in measured if switching(r)], switching_s),
        "steady": _summary([r for r in measured if not switching(r)], end - start - switching_s),
        "switches": switches,
        "failed": sum(not r.ok for r in records),
        "served_by": {m: sum(r.model == m for r in records) for m in sorted({str(r.model) for r in records})},
    }


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("version-switch", help="TTFT and throughput during a model version switch vs steady, "
                       "and admin call -> last replica applied", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = SwitchBenchConfig()
    p.add_argument("--streams", type=int, default=d.streams, help="streams in flight, half on each replica")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    p.add_argument("--steady-s", type=float, default=d.steady_s, help="seconds before, between and after the switches")
    p.add_argument("--window-s", type=float, default=d.window_s, help="seconds after a switch that count as switching")
    p.add_argument("--pg-url", default=d.pg_url, help="PostgreSQL server (a fresh database is made and dropped)")
    p.add_argument("--redis-url", default=d.redis_url)
    p.add_argument("--v1", default=None, help="v1's source (default: a tiny random Llama)")
    p.add_argument("--v2", default=None, help="v2's source (default: another tiny random Llama)")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = SwitchBenchConfig(streams=args.streams, max_tokens=args.max_tokens, steady_s=args.steady_s,
                               window_s=args.window_s, pg_url=args.pg_url, redis_url=args.redis_url, v1=args.v1,
                               v2=args.v2, dtype=args.dtype)
    report = run(config)
    print(f"version switch, {config.streams} streams over 2 replicas, {config.max_tokens} tokens per request")
    for name in ("steady", "switching"):
        s = report[name]
        print(f"  {name:9}  {s.get('requests', 0)} requests, TTFT p50 {s.get('ttft_p50_ms')} ms p99 "
              f"{s.get('ttft_p99_ms')} ms, {s.get('requests_per_s')} req/s, {s.get('tokens_per_s')} tokens/s")
    for s in report["switches"]:
        print(f"  generation {s['generation']}: admin call {s['admin_call_ms']} ms, last replica applied "
              f"{s['last_replica_applied_ms']} ms after the call (per replica {s['per_replica_applied_ms']})")
    print(f"  failed requests: {report['failed']}; served by {report['served_by']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1
