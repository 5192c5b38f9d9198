"""Model versions across two `sluice serve --driver native` replicas sharing PostgreSQL and Redis.

Two tiny random Llamas saved as Hugging Face folders are the versions: v1 is the model each replica
started with (its engine adopted), v2 is loaded beside it. Their greedy answers differ, so every
response shows which version produced it. (The bundled GGUF would do as v1, but two replicas loading
it take minutes on the shared CI machine; it serves here as the version too big for the budget.)
Under continuous streaming load the alias goes v1 -> v2 -> canary 90/10 -> rolled back -> v2 again,
and no request fails, none mixes versions, none admitted after a replica applied a generation (or
more than 1 s after the admin's call was answered) is served by a version that generation does not
name, and v1, which no alias references any more, drains and is unloaded on both replicas.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
from gateway_server import Server, start_server

from benchmarks.version_models import tiny_llama, unsupported
from engine_native.model.bundled import bundled_model_path
from engine_native.model.inspect import inspect_model
from tenants.db import create_postgres_database, drop_postgres_database
from tests.polling import wait_until as poll_until

PG_SERVER = os.environ.get("SLUICE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN = {"authorization": "Bearer versions-admin-key", "x-sluice-actor": "release-bot"}
MODEL = "smol"
HANG_S = 120.0  # deadlines only catch hangs (two engines per replica load on a shared 2-core machine)
STREAMS = 32  # concurrent streams, half on each replica
CANARY_SAMPLE = 400  # requests pinned to the canary generation the split is measured over
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 2
KV_BYTES = 16 * 2**20  # each engine's KV pool (--kv-cache-memory)
DTYPE = "float32"  # greedy picks independent of the batch they run in
KEEPALIVE_S = 1.0  # the client's idle-connection expiry


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("versions")
    return {"v1": tiny_llama(folder, seed=1), "v2": tiny_llama(folder, seed=2), "unsupported": unsupported(folder)}


def budget(sources: dict[str, Path]) -> int:
    """Room for v1 and v2 and as much again: the bundled model does not fit (measured as the server
    measures)."""
    tiny = inspect_model(str(sources["v1"]), DTYPE).weight_bytes + KV_BYTES
    assert inspect_model(bundled_model_path(), DTYPE).weight_bytes > 2 * tiny
    return 4 * tiny


@pytest.fixture(scope="module")
def pair(sources: dict[str, Path]) -> Iterator[list[Server]]:
    url = f"{PG_SERVER.rsplit('/', 1)[0]}/sluice_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_postgres_database(url))
    env = {
        "DATABASE_URL": url, "REDIS_URL": REDIS_URL, "SLUICE_ADMIN_KEY": ADMIN["authorization"].split()[1],
        "SLUICE_RATELIMIT_TIMEOUT_MS": "5000",
        # A long fallback period: a generation reaching the other replica must have come through Redis.
        "SLUICE_REGISTRY_REFRESH_S": "600",
    }
    options = ("--driver", "native", "--model", str(sources["v1"]), "--served-model-name", "boot", "--dtype", DTYPE,
               "--max-model-len", "256", "--kv-cache-memory", str(KV_BYTES), "--num-threads", "1",
               "--max-num-seqs", str(STREAMS), "--model-memory-budget", str(budget(sources)))
    try:
        with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
            gens = [start_server(*options, auth=True, env=env, startup_timeout_s=600) for _ in range(2)]
            for gen in gens:
                stack.callback(lambda g=gen: next(g, None))  # runs start_server's finally: terminate
            yield list(pool.map(next, gens))  # both load their engines at once
    finally:
        asyncio.run(drop_postgres_database(url))


@pytest.fixture(scope="module")
def secret(pair: list[Server]) -> str:
    tenant = httpx.post(f"{pair[0].base_url}/admin/tenants", headers=ADMIN, json={
        "name": f"t-{uuid.uuid4().hex[:8]}", "requests_per_minute": None, "tokens_per_minute": None,
        "max_concurrent": None,
    })
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(f"{pair[0].base_url}/admin/tenants/{tenant.json()['id']}/keys", headers=ADMIN,
                     json={"name": "k"})
    assert key.status_code == 201, key.text
    return str(key.json()["key"])


# ----- the admin side -------------------------------------------------------------------------------


def admin(server: Server, method: str, path: str, **body: Any) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", headers=ADMIN, json=body or None, timeout=HANG_S)


def model_view(server: Server) -> dict[str, Any]:
    resp = admin(server, "GET", f"/admin/models/{MODEL}")
    assert resp.status_code == 200, resp.text
    view: dict[str, Any] = resp.json()
    return view


def version_view(server: Server, version: str) -> dict[str, Any]:
    return next(v for v in model_view(server)["versions"] if v["version"] == version)


def wait_until(what: str, predicate: Any) -> Any:
    return poll_until(predicate, what, HANG_S)


def deploy(pair: list[Server], version: str, source: str) -> None:
    created = admin(pair[0], "POST", f"/admin/models/{MODEL}/versions", version=version, source=source, dtype=DTYPE)
    assert created.status_code == 201, created.text
    deployed = admin(pair[0], "POST", f"/admin/models/{MODEL}/versions/{version}/deploy")
    assert deployed.status_code == 200, deployed.text
    assert deployed.json()["state"] == "ready" and deployed.json()["hosted_here"]
    wait_until(f"{version} hosted on replica 1", lambda: version_view(pair[1], version)["hosted_here"])


CALLED, ANSWERED = -1, -2  # keys of switch()'s answer that are not replicas
APPLY_S = 1.0  # the bound: a request admitted this long after a switch never reaches the old version


def switch(pair: list[Server], weights: dict[str, int] | None, generation: int) -> dict[int, float]:
    """Set the alias (None: roll back) from `generation`; returns when each replica applied the new one
    (time.time()), and when the admin call was made (CALLED) and answered (ANSWERED)."""
    called = time.time()
    if weights is None:
        resp = admin(pair[0], "POST", f"/admin/models/{MODEL}/rollback", generation=generation)
    else:
        resp = admin(pair[0], "PUT", f"/admin/models/{MODEL}/alias", weights=weights, generation=generation)
    assert resp.status_code == 200, resp.text
    assert resp.json()["generation"] == generation + 1
    applied = {CALLED: called, ANSWERED: time.time()}
    for i, server in enumerate(pair):
        view = wait_until(f"generation {generation + 1} on replica {i}",
                          lambda s=server: (v := model_view(s))["applied"]["generation"] == generation + 1 and v)
        applied[i] = view["applied"]["applied_at"]
    return applied


# ----- the client side ------------------------------------------------------------------------------


@dataclass
class Outcome:
    replica: int
    sent: float  # time.time() the request left
    status: int = 0
    generation: int | None = None
    models: set[str] = field(default_factory=set)
    fingerprints: set[str | None] = field(default_factory=set)
    text: str = ""
    finish: str | None = None
    done: bool = False
    errors: list[str] = field(default_factory=list)
    ttft: float | None = None  # seconds to the first content
    ended: float = 0.0  # time.time() of the last byte

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finish is not None and not self.errors

    @property
    def model(self) -> str:
        assert len(self.models) == 1, self.models
        return next(iter(self.models))


async def stream_once(client: httpx.AsyncClient, server: Server, replica: int, secret: str, model: str) -> Outcome:
    out = Outcome(replica, time.time())
    body = {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"{server.v1}/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {secret}"}) as resp:
            out.status = resp.status_code
            if "x-sluice-model-generation" in resp.headers:
                out.generation = int(resp.headers["x-sluice-model-generation"])
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(str(chunk["error"]))
                    continue
                out.models.add(chunk["model"])
                out.fingerprints.add(chunk.get("system_fingerprint"))
                for choice in chunk["choices"]:
                    content = choice["delta"].get("content") or ""
                    if content and out.ttft is None:
                        out.ttft = time.time() - out.sent
                    out.text += content
                    out.finish = choice.get("finish_reason") or out.finish
    except httpx.HTTPError as exc:
        out.errors.append(repr(exc))
    out.ended = time.time()
    return out


class Load:
    """STREAMS clients streaming back to back, alternating replicas, in a thread of their own."""

    def __init__(self, pair: list[Server], secret: str) -> None:
        self.pair, self.secret = pair, secret
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        # Idle connections expire here well before the server's keep-alive timeout (uvicorn: 5 s), so
        # a request never goes out on a connection the server is closing (a ReadError on a starved host).
        limits = httpx.Limits(max_connections=STREAMS, keepalive_expiry=KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=HANG_S, limits=limits) as client:
            async def worker(i: int) -> None:
                replica = i % 2
                while not self._stop.is_set():
                    self.outcomes.append(await stream_once(client, self.pair[replica], replica, self.secret, MODEL))

            await asyncio.gather(*(worker(i) for i in range(STREAMS)))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(HANG_S)

    def wait_for(self, what: str, predicate: Any) -> None:
        wait_until(what, lambda: predicate(list(self.outcomes)))


def greedy(server: Server, secret: str, model: str) -> tuple[str, str]:
    """(text, model) of one greedy answer of `model` through `server`."""
    out = asyncio.run(_one(server, secret, model))
    assert out.ok, out
    return out.text, out.model


async def _one(server: Server, secret: str, model: str) -> Outcome:
    async with httpx.AsyncClient(timeout=HANG_S) as client:
        return await stream_once(client, server, 0, secret, model)


def print_figures(outcomes: list[Outcome], applied: dict[int, dict[int, float]]) -> None:
    """The closing note's figures (pytest -s shows them): client TTFT p99 and throughput in the second
    around each switch vs the steady stretches between, and admin call -> last replica applied."""
    around = [(w[CALLED] - 0.5, w[CALLED] + 1.5) for w in applied.values()]

    def near(o: Outcome) -> bool:
        return any(a <= o.sent <= b for a, b in around)

    def summary(group: list[Outcome]) -> str:
        ttfts = sorted(o.ttft for o in group if o.ttft is not None)
        if not ttfts:
            return "none"
        span = max(o.ended for o in group) - min(o.sent for o in group)
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        return f"{len(group)} requests, TTFT p99 {p99 * 1000:.0f} ms, {len(group) / span:.1f} req/s over {span:.1f} s"

    print("\nswitching:", summary([o for o in outcomes if near(o)]))
    print("steady:   ", summary([o for o in outcomes if not near(o)]))
    for generation, when in applied.items():
        lag = max(t for r, t in when.items() if r >= 0) - when[CALLED]
        print(f"generation {generation}: admin call -> last replica applied {lag * 1000:.0f} ms")


# ----- the tests ------------------------------------------------------------------------------------


def test_switch_canary_and_rollback_under_load_lose_nothing(
    pair: list[Server], secret: str, sources: dict[str, Path]
) -> None:
    deploy(pair, "v1", str(sources["v1"]))  # adopts the engine each replica started with
    switch(pair, {"v1": 100}, 0)
    deploy(pair, "v2", str(sources["v2"]))
    expected = {f"{MODEL}@{v}": greedy(pair[0], secret, f"{MODEL}@{v}")[0] for v in ("v1", "v2")}
    assert expected[f"{MODEL}@v1"] != expected[f"{MODEL}@v2"], expected
    weights = {1: {"v1": 100}, 2: {"v2": 100}, 3: {"v1": 90, "v2": 10}, 4: {"v2": 100}, 5: {"v2": 100}}
    applied: dict[int, dict[int, float]] = {}

    with Load(pair, secret) as load:
        load.wait_for("traffic on v1", lambda outs: len(outs) >= 2 * STREAMS)
        applied[2] = switch(pair, weights[2], 1)
        load.wait_for("traffic on v2", lambda outs: sum(o.generation == 2 for o in outs) >= 2 * STREAMS)
        applied[3] = switch(pair, weights[3], 2)
        load.wait_for("the canary sample", lambda outs: sum(o.generation == 3 for o in outs) >= CANARY_SAMPLE)
        applied[4] = switch(pair, None, 3)  # roll back to generation 2's weights
        load.wait_for("traffic after the rollback", lambda outs: sum(o.generation == 4 for o in outs) >= 2 * STREAMS)
        # Generations 5 and 4 do not name v1 (nor does a pin): it drains and is unloaded, under load.
        applied[5] = switch(pair, weights[5], 4)
        for i, server in enumerate(pair):
            wait_until(f"v1 unloaded on replica {i}", lambda s=server: not version_view(s, "v1")["hosted_here"])
        wait_until("v1 released", lambda: version_view(pair[0], "v1")["state"] == "registered")
        load.wait_for("traffic after the release", lambda outs: sum(o.generation == 5 for o in outs) >= 2 * STREAMS)
        # The 1 s bound below needs requests sent after it: on a fast host the phase above can end sooner.
        load.wait_for("traffic sent over 1 s after the last switch's answer",
                      lambda outs: any(o.sent > applied[5][ANSWERED] + APPLY_S for o in outs))
    outcomes = load.outcomes

    failed = [o for o in outcomes if not o.ok]
    # A stream lost before any response byte (status 0) was seen twice under load (a full run, a loaded host) and
    # never alone: the switches' times and both servers' logs (an exception the app raised is logged) go with it.
    assert not failed, (failed[:5], applied, [server.log_tail() for server in pair])
    for o in outcomes:
        assert len(o.models) == 1 and len(o.fingerprints) == 1, o  # one version produced all of it
        assert o.text == expected[o.model], o  # ... and its greedy answer is that version's
        assert o.generation is not None and o.model.split("@")[1] in weights[o.generation], o
    # Admitted after a replica applied a generation: never an older generation's version on that replica.
    for generation, when in applied.items():
        late = [o for o in outcomes if o.sent > when[o.replica]]
        assert late and all(o.generation is not None and o.generation >= generation for o in late)
        late = [o for o in outcomes if o.sent > when[ANSWERED] + APPLY_S]
        assert late and all(o.generation is not None and o.generation >= generation for o in late), generation
    canary = [o for o in outcomes if o.generation == 3]
    share = 100 * sum(o.model == f"{MODEL}@v2" for o in canary) / len(canary)
    assert 5 <= share <= 15, (share, len(canary))
    fingerprints = {o.model: o.fingerprints for o in outcomes}
    assert fingerprints[f"{MODEL}@v1"] != fingerprints[f"{MODEL}@v2"]

    print_figures(outcomes, applied)
    changes = admin(pair[1], "GET", f"/admin/models/{MODEL}/changes").json()["data"]
    assert [c["action"] for c in changes if c["version"] is None][:5] == ["alias", "rollback", "alias", "alias", "alias"]
    assert [c["action"] for c in changes if c["version"] == "v1"][:2] == ["unloaded", "release"]
    assert all(c["actor"] == "release-bot" for c in changes)


def test_a_tenant_limited_to_a_pinned_version_on_every_replica(pair: list[Server], secret: str) -> None:
    redeploy = admin(pair[0], "POST", f"/admin/models/{MODEL}/versions/v1/deploy")  # released by the load test
    assert redeploy.status_code == 200 and redeploy.json()["state"] == "ready", redeploy.text
    wait_until("v1 hosted on replica 1 again", lambda: version_view(pair[1], "v1")["hosted_here"])
    tenant = admin(pair[0], "POST", "/admin/tenants", name=f"t-{uuid.uuid4().hex[:8]}", requests_per_minute=None)
    key = admin(pair[0], "POST", f"/admin/tenants/{tenant.json()['id']}/keys", name="k").json()["key"]
    path = f"/admin/tenants/{tenant.json()['id']}/models"
    assert admin(pair[0], "PUT", path, models={MODEL: "nope"}).status_code == 404  # no such version
    # The alias says v2; this tenant is pinned to v1, and only "smol" is on its list.
    limited = admin(pair[0], "PUT", path, models={MODEL: "v1"})
    assert limited.status_code == 200 and limited.json() == {"models": {MODEL: "v1"}}
    wait_until("the pin on replica 1", lambda: greedy(pair[1], key, MODEL)[1] == f"{MODEL}@v1")
    listed = httpx.get(f"{pair[1].v1}/models", headers={"authorization": f"Bearer {key}"}).json()["data"]
    assert [m["id"] for m in listed] == [MODEL]
    assert greedy(pair[1], secret, MODEL)[1] == f"{MODEL}@v2"  # other tenants: the alias
    other = httpx.post(f"{pair[1].v1}/chat/completions", headers={"authorization": f"Bearer {key}"},
                       json={"model": "boot", "messages": PROMPT, "max_tokens": 1}, timeout=HANG_S)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert admin(pair[1], "PUT", path, models=None).json() == {"models": None}
    assert admin(pair[0], "GET", path).json() == {"models": None}
    wait_until("the pin lifted on replica 0", lambda: greedy(pair[0], key, MODEL)[1] == f"{MODEL}@v2")


def test_retiring_unloads_the_old_version_everywhere_and_is_refused_while_referenced(
    pair: list[Server], secret: str
) -> None:
    refused = admin(pair[1], "POST", f"/admin/models/{MODEL}/versions/v2/retire")
    assert refused.status_code == 409 and "alias" in refused.json()["error"]["message"], refused.text
    assert version_view(pair[0], "v2")["state"] == "ready"

    retiring = admin(pair[1], "POST", f"/admin/models/{MODEL}/versions/v1/retire")
    assert retiring.status_code == 202, retiring.text
    assert retiring.json()["state"] in ("draining", "retired")
    for server in pair:
        wait_until("v1 unloaded", lambda s=server: not version_view(s, "v1")["hosted_here"])
    wait_until("v1 retired", lambda: version_view(pair[0], "v1")["state"] == "retired")
    gone = httpx.post(f"{pair[0].v1}/chat/completions", headers={"authorization": f"Bearer {secret}"},
                      json={"model": f"{MODEL}@v1", "messages": PROMPT, "max_tokens": 1}, timeout=HANG_S)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(f"{pair[1].v1}/models", headers={"authorization": f"Bearer {secret}"}).json()["data"]
    assert MODEL in [m["id"] for m in listed] and not any("@" in m["id"] for m in listed)
    assert greedy(pair[1], secret, MODEL)[1] == f"{MODEL}@v2"


@pytest.mark.parametrize(("version", "source", "reason"), [
    ("missing", "/nonexistent/model.gguf", "missing_source"),
    ("gpt2", "unsupported", "unsupported_architecture"),
    ("big", "bundled", "over_budget"),  # the bundled model: past the budget
])
def test_a_refused_deploy_changes_nothing_that_serves(
    pair: list[Server], secret: str, sources: dict[str, Path], version: str, source: str, reason: str
) -> None:
    path = {"unsupported": str(sources["unsupported"]), "bundled": bundled_model_path()}.get(source, source)
    before = model_view(pair[0])
    created = admin(pair[0], "POST", f"/admin/models/{MODEL}/versions", version=version, source=path, dtype=DTYPE)
    assert created.status_code == 201, created.text
    refused = admin(pair[0], "POST", f"/admin/models/{MODEL}/versions/{version}/deploy")
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == reason
    after = model_view(pair[0])
    assert after["alias"] == before["alias"] and after["applied"] == before["applied"]
    states = {v["version"]: (v["state"], v["hosted_here"]) for v in after["versions"]}
    assert states.pop(version) == ("registered", False)
    assert states == {v["version"]: (v["state"], v["hosted_here"]) for v in before["versions"]}
    assert greedy(pair[0], secret, MODEL)[1] == f"{MODEL}@v2"
    changes = admin(pair[0], "GET", f"/admin/models/{MODEL}/changes").json()["data"]
    assert changes[0]["action"] == "deploy_refused" and reason in changes[0]["detail"]


def test_alias_changes_are_compare_and_set_and_bad_input_is_400(pair: list[Server]) -> None:
    current = model_view(pair[1])["alias"]["generation"]
    stale = admin(pair[1], "PUT", f"/admin/models/{MODEL}/alias", weights={"v2": 100}, generation=current - 1)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "conflict"
    not_ready = admin(pair[1], "PUT", f"/admin/models/{MODEL}/alias", weights={"missing": 100}, generation=current)
    assert not_ready.status_code == 409 and "registered" in not_ready.json()["error"]["message"]
    for weights in ({"v2": 60}, {"v2": 101}, {"v2": -1}, {"bad name!": 100}, {}):
        bad = admin(pair[1], "PUT", f"/admin/models/{MODEL}/alias", weights=weights, generation=current)
        assert bad.status_code == 400, (weights, bad.text)
    unknown = admin(pair[1], "PUT", "/admin/models/nope/alias", weights={"v1": 100}, generation=0)
    assert unknown.status_code == 404
    assert model_view(pair[0])["alias"]["generation"] == current

