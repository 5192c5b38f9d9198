"""A real `sluice worker --driver synthetic` on its own: the fleet wire, its probes, the fleet secret,
bad input as 4xx (never a 500), keepalives while a request waits, and abort when the stream closes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from fleet_processes import WorkerProcess, wait_for

from drivers.fleet import wire
from drivers.portable_tokenizer import SPEC_DECODER, fingerprint
from tests.server_choice import runs_on_uvloop_and_httptools

SECRET = "fleet-test-secret"
AUTH = {"authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    # 20 tokens/s and a 1.2 s first token: slow enough to close a stream mid-way and to see keepalives.
    w = WorkerProcess("solo", ["--driver", "synthetic", "--synthetic-tokens-per-second", "20",
                               "--synthetic-ttft-ms", "1200", "--max-model-len", "256"],
                      env={"SLUICE_FLEET_SECRET": SECRET})
    yield w
    w.stop()


def submit(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {"request_id": "r1", "model": "synthetic", "prompt_token_ids": [5, 6, 7],
                               "sampling": {"max_tokens": 3, "temperature": 0}}
    body.update(overrides)
    return body


def test_probes_and_info(worker: WorkerProcess) -> None:
    assert httpx.get(f"{worker.url}/healthz").status_code == 200
    assert httpx.get(f"{worker.url}/readyz").json() == {"ready": True, "state": "ready"}
    info = msgspec.json.decode(httpx.get(f"{worker.url}{wire.INFO_PATH}", headers=AUTH).content, type=wire.WorkerInfo)
    assert (info.id, info.state, info.address) == ("solo", wire.WorkerState.READY, worker.url)
    assert [c.id for c in info.models] == ["synthetic"] and info.incarnation > 0
    assert "sluice_worker_in_flight" in httpx.get(f"{worker.url}/metrics").text


def test_the_worker_serves_on_uvloop_and_httptools(worker: WorkerProcess) -> None:
    assert httpx.get(f"{worker.url}/healthz").status_code == 200
    assert runs_on_uvloop_and_httptools(worker.process.pid)  # gateway/server_choice.py


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": SECRET}])
def test_fleet_routes_need_the_secret(worker: WorkerProcess, headers: dict[str, str]) -> None:
    for method, path in [("GET", wire.INFO_PATH), ("POST", wire.GENERATE_PATH), ("POST", wire.TOKENIZE_PATH),
                         ("GET", wire.TOKENIZER_PATH)]:
        r = httpx.request(method, worker.url + path, headers=headers, json=submit())
        assert r.status_code == 401, (path, r.text)
        assert r.json()["kind"] == "unauthorized"


def test_generate_streams_tokens_with_timestamps(worker: WorkerProcess) -> None:
    r = httpx.post(worker.url + wire.GENERATE_PATH, headers=AUTH, json=submit(), timeout=30)
    assert r.status_code == 200
    events = [wire.STREAM_DECODER.decode(line) for line in r.text.splitlines()]
    tokens = [e for e in events if isinstance(e, wire.TokensEvent)]
    assert [len(e.token_ids) for e in tokens] == [1, 1, 1]
    assert all(len(e.token_times) == 1 for e in tokens)
    assert [e.completion_tokens for e in tokens] == [1, 2, 3]
    assert tokens[-1].finish_reason == "length" and tokens[-1].prompt_tokens == 3
    # 1.2 s to the first token, keepalives every 0.5 s: a waiting request is never silent.
    assert isinstance(events[0], wire.KeepAlive)


def test_tokenize(worker: WorkerProcess) -> None:
    r = httpx.post(worker.url + wire.TOKENIZE_PATH, headers=AUTH, json={"model": "synthetic", "prompt": "a b"})
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
    r = httpx.post(worker.url + wire.TOKENIZE_PATH, headers=AUTH, json={"model": "synthetic"})
    assert r.status_code == 400


def test_the_tokenizer_travels_named_by_its_fingerprint(worker: WorkerProcess) -> None:
    info = msgspec.json.decode(httpx.get(f"{worker.url}{wire.INFO_PATH}", headers=AUTH).content, type=wire.WorkerInfo)
    r = httpx.get(worker.url + wire.TOKENIZER_PATH, headers=AUTH, params={"model": "synthetic"})
    assert r.status_code == 200 and fingerprint(SPEC_DECODER.decode(r.content)) == info.tokenizers["synthetic"]
    for params in ({"model": "nope"}, {}):  # unknown model, no model: a 404 error body, never a 500
        r = httpx.get(worker.url + wire.TOKENIZER_PATH, headers=AUTH, params=params)
        assert (r.status_code, r.json()["kind"]) == (404, "model_not_found")


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[]", 400, "invalid request body"),
    (json.dumps(submit(request_id=None)).encode(), 400, "request_id"),
    (json.dumps(submit(prompt_token_ids=[])).encode(), 400, "empty"),
    (json.dumps(submit(prompt_token_ids=["x"])).encode(), 400, "invalid request body"),
    (json.dumps(submit(sampling={"max_tokens": 0})).encode(), 400, "max_tokens"),
    (json.dumps(submit(sampling={"max_tokens": 1000})).encode(), 400, "context length"),
    (json.dumps(submit(prompt_token_ids=[99999999])).encode(), 400, "out of vocabulary"),
    (json.dumps(submit(resumed_tokens=3)).encode(), 400, "resumed_tokens"),
    (json.dumps(submit(prefix_key=1 << 63)).encode(), 400, "prefix_key"),
    (json.dumps(submit(prefix_key=-1)).encode(), 400, "prefix_key"),
    (json.dumps(submit(model="nope")).encode(), 404, "nope"),
    (json.dumps(submit(incarnation=1)).encode(), 409, "incarnation"),
    (json.dumps(submit(deadline=1.0)).encode(), 503, "deadline"),
    (b"x" * (9 << 20), 413, "too large"),
])
def test_bad_input_is_a_clear_4xx(worker: WorkerProcess, body: bytes, status: int, fragment: str) -> None:
    r = httpx.post(worker.url + wire.GENERATE_PATH, headers={**AUTH, "content-type": "application/json"},
                   content=body, timeout=30)
    assert r.status_code == status, r.text
    assert fragment in r.json()["message"]


def test_unknown_route_is_404(worker: WorkerProcess) -> None:
    assert httpx.get(f"{worker.url}/nope").status_code == 404


def test_closing_the_stream_aborts_the_request(worker: WorkerProcess) -> None:
    def running() -> int:
        info = httpx.get(worker.url + wire.INFO_PATH, headers=AUTH).json()
        return int(info["load"]["running"]) + int(info["load"]["in_flight"])

    body = submit(request_id="long", sampling={"max_tokens": 200, "temperature": 0})
    with httpx.stream("POST", worker.url + wire.GENERATE_PATH, headers=AUTH, json=body, timeout=30) as r:
        lines = r.iter_lines()
        while "tokens" not in next(lines):
            pass
        assert running() == 2  # the engine runs it, and its stream is open
    # 200 tokens at 20/s would take 10 s; closed after the first, the engine lets go of it.
    wait_for("the request aborted", lambda: running() == 0, 8)


def test_info_lists_the_prefixes_requests_came_with_most_recent_last(worker: WorkerProcess) -> None:
    for i, key in enumerate([11, 22, 11]):  # 11 again: it moves to the end
        r = httpx.post(worker.url + wire.GENERATE_PATH, headers=AUTH, timeout=30,
                       json=submit(request_id=f"p{i}", prefix_key=key, prompt_token_ids=list(range(1, 41)),
                                   sampling={"max_tokens": 1}))
        assert r.status_code == 200, r.text
    info = msgspec.json.decode(httpx.get(f"{worker.url}{wire.INFO_PATH}", headers=AUTH).content, type=wire.WorkerInfo)
    held = [(p.key, p.blocks) for p in info.prefixes]
    assert held[-2:] == [(22, 3), (11, 3)]  # 40 prompt tokens: 3 blocks of 16
    assert all(0 <= p.idle_s < 60 for p in info.prefixes)
