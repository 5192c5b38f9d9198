"""What a tenant is charged (docs/billing.md), through the real app with the synthetic engine:
refused requests cost nothing and give their reserved tokens back, every request counts against
the request limit before its prompt is tokenized, and latency counts from arrival.

In-process apps with auth on (SQLite); the disconnect cases run a real server, whose client can
really go away."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from gateway_server import Server, start_server
from litestar.testing import TestClient

from drivers.base import GenerationRequest
from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.settings import Settings

ADMIN_KEY = "billing-admin-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TPM = 2_000  # tokens per minute of the tenants below; refills ~33 tokens a second
BIG = " ".join(f"w{i}" for i in range(1_000))  # 1,001 synthetic tokens with BOS
PROBE = " ".join(f"p{i}" for i in range(1_480))  # 1,481 tokens: fits the bucket only if BIG's came back


class App:
    def __init__(self, client: TestClient[Any], driver: SyntheticDriver) -> None:
        self.client = client
        self.driver = driver

    def tenant(self, **limits: Any) -> dict[str, str]:
        return make_tenant(self.client.post, **limits)

    def usage(self, headers: dict[str, str], requests: int) -> dict[str, int]:
        return usage_of(lambda: self.client.get("/v1/usage?group_by=model", headers=headers).json(), requests)

    def completion(self, headers: dict[str, str], prompt: Any, max_tokens: int = 10, **extra: Any) -> Any:
        body = {"prompt": prompt, "max_tokens": max_tokens, **extra}
        return self.client.post("/v1/completions", json=body, headers=headers)


def make_tenant(post: Callable[..., Any], **limits: Any) -> dict[str, str]:
    """Headers with a key of a new tenant (no concurrency cap unless asked)."""
    body = {"name": f"t-{uuid.uuid4().hex[:8]}", "max_concurrent": None, **limits}
    tenant = post("/admin/tenants", json=body, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = post(f"/admin/tenants/{tenant.json()['id']}/keys", json={"name": "k"}, headers=ADMIN)
    assert key.status_code == 201, key.text
    return {"authorization": f"Bearer {key.json()['key']}"}


def usage_of(read: Callable[[], dict[str, Any]], requests: int) -> dict[str, int]:
    """Summed usage once `requests` records are written (the writer flushes off the request path)."""
    deadline = time.monotonic() + 30
    while True:
        data = read()["data"]
        if sum(b["requests"] for b in data) >= requests:
            return {k: sum(b[k] for b in data) for k in ("requests", "prompt_tokens", "completion_tokens")}
        assert time.monotonic() < deadline, data
        time.sleep(0.05)


@contextmanager
def app(tmp_path: Path, driver: SyntheticDriver, **settings: Any) -> Iterator[App]:
    config = Settings(data_dir=str(tmp_path), admin_key=ADMIN_KEY, usage_flush_interval_s=0.02, **settings)
    with TestClient(create_app(config, driver), timeout=60) as client:
        yield App(client, driver)


# -- refused or failed before it ran: charged nothing, its tokens back in the bucket -------------------


@contextmanager
def queue_full(client: TestClient[Any], driver: SyntheticDriver) -> Iterator[None]:
    """The engine's one slot is taken by a long generation and its queue holds nothing."""
    portal = client.blocking_portal
    assert portal is not None
    request = GenerationRequest(request_id="holder", model="synthetic", prompt="x", max_tokens=3_000)

    async def hold() -> Any:
        stream = driver.generate(request)
        await anext(stream)
        return stream

    stream = portal.call(hold)
    try:
        yield
    finally:
        portal.call(stream.aclose)


@contextmanager
def engine_stopped(client: TestClient[Any], driver: SyntheticDriver) -> Iterator[None]:
    portal = client.blocking_portal
    assert portal is not None
    portal.call(driver.stop)
    try:
        yield
    finally:
        portal.call(driver.start)


@contextmanager
def nothing(client: TestClient[Any], driver: SyntheticDriver) -> Iterator[None]:
    yield


State = Callable[[TestClient[Any], SyntheticDriver], AbstractContextManager[None]]
REFUSALS: dict[str, tuple[dict[str, Any], dict[str, Any], State, int]] = {
    # name: (driver options, settings, state, status of BIG)
    "queue full": ({"max_num_seqs": 1, "max_waiting": 0}, {"load_shedding": False}, queue_full, 503),
    "engine not running": ({}, {"load_shedding": False}, engine_stopped, 503),
    "timed out before the first token": ({"ttft_s": 30.0}, {"stream_timeout_s": 0.5}, nothing, 504),
    # Tier 1 may fill 40% of a 1-place queue: none of it (shares are rounded).
    "shed": ({"max_num_seqs": 1, "max_waiting": 1}, {"queue_share": (1.0, 0.4, 0.4)}, nothing, 503),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_request_refused_before_it_ran_is_not_charged_and_gives_its_tokens_back(
    tmp_path: Path, case: str
) -> None:
    options, settings, state, status = REFUSALS[case]
    driver = SyntheticDriver(**{"tokens_per_second": 0, "ttft_s": 0, **options})
    with app(tmp_path, driver, **settings) as a:
        headers = a.tenant(tokens_per_minute=TPM)
        with state(a.client, a.driver):
            refused = a.completion(headers, BIG)
            assert refused.status_code == status, refused.text
            # BIG's 1,011 tokens went back: PROBE's 1,491 fit the 2,000 (without the refund they would
            # not, until ~15 s of refill). PROBE itself is refused the same way, or runs.
            probe = a.completion(headers, PROBE)
            assert probe.status_code in (status, 200), probe.text
        charged = probe.json()["usage"] if probe.status_code == 200 else {"prompt_tokens": 0, "completion_tokens": 0}
        usage = a.usage(headers, requests=2)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            charged["prompt_tokens"], charged["completion_tokens"]
        )


def test_client_errors_are_not_charged(tmp_path: Path) -> None:
    with app(tmp_path, SyntheticDriver(tokens_per_second=0, ttft_s=0, max_model_len=1_024)) as a:
        headers = a.tenant(tokens_per_minute=TPM)
        assert a.completion(headers, BIG, max_tokens=500).status_code == 400  # over the context
        assert a.completion(headers, "hi", model="nope").status_code == 404
        assert a.completion(headers, "hi", echo=True).status_code == 400
        assert a.usage(headers, requests=3) == {"requests": 3, "prompt_tokens": 0, "completion_tokens": 0}


# -- counted before the expensive work ------------------------------------------------------------------


def test_requests_rejected_at_dispatch_count_against_the_request_limit_before_tokenizing(tmp_path: Path) -> None:
    driver = SyntheticDriver(tokens_per_second=0, ttft_s=0, max_model_len=1_024)
    with app(tmp_path, driver) as a:
        headers = a.tenant(requests_per_minute=2)
        too_long = " ".join(["word"] * 2_000)  # passes the byte cap, overflows the context once tokenized
        for _ in range(2):
            assert a.completion(headers, too_long).status_code == 400
        tokenized = driver.prompts_tokenized
        refused = a.completion(headers, too_long)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert driver.prompts_tokenized == tokenized  # refused before the tokenizer saw it


def test_a_request_takes_one_concurrency_slot_per_sequence(tmp_path: Path) -> None:
    with app(tmp_path, SyntheticDriver(tokens_per_second=0, ttft_s=0)) as a:
        headers = a.tenant(max_concurrent=4)
        assert a.completion(headers, ["a", "b"], max_tokens=1, n=2).status_code == 200  # 4 sequences
        refused = a.completion(headers, ["a", "b"], max_tokens=1, n=3)  # 6 sequences: never fits 4
        assert refused.status_code == 429, refused.text
        assert "sequences" in refused.json()["error"]["message"]


# -- what a request that ran is charged -------------------------------------------------------------------


def test_a_completion_whose_first_token_ends_it_is_charged_its_prompt_and_that_token(tmp_path: Path) -> None:
    with app(tmp_path, SyntheticDriver(tokens_per_second=0, ttft_s=0)) as a:
        first_word = a.completion(a.tenant(), "a b c", max_tokens=1, seed=7).json()["choices"][0]["text"]
        headers = a.tenant()
        resp = a.completion(headers, "a b c", max_tokens=5, seed=7, stop=[first_word])
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("", "stop")  # prefill ran, no text came out
        assert resp.json()["usage"]["completion_tokens"] == 1
        usage = a.usage(headers, requests=1)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 1)


def test_n_choices_share_one_prompt_charge(tmp_path: Path) -> None:
    with app(tmp_path, SyntheticDriver(tokens_per_second=0, ttft_s=0)) as a:
        headers = a.tenant()
        resp = a.completion(headers, "a b c", max_tokens=2, n=3)
        assert resp.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
        usage = a.usage(headers, requests=1)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 6)


# -- latency from arrival ---------------------------------------------------------------------------------


def test_time_to_first_token_counts_from_arrival_not_from_dispatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.gateway")
    tokenize_s = 0.3  # a slow tokenizer: the request spends at least this long before dispatch
    with app(tmp_path, SyntheticDriver(tokens_per_second=0, ttft_s=0, tokenize_s=tokenize_s)) as a:
        headers = a.tenant()
        resp = a.completion(headers, "a b c", max_tokens=2)
        assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + 30
        while (latency := a.client.get("/v1/usage/latency", headers=headers).json())["overall"]["requests"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # The usage record's TTFT and latency include the time before dispatch...
    ttft_ms, latency_ms = latency["overall"]["ttft_ms"]["p50"], latency["overall"]["latency_ms"]["p50"]
    assert ttft_ms >= tokenize_s * 1000
    assert latency_ms >= ttft_ms
    # ... which the request's log line shows as its own figure, beside the TTFT it reports.
    line = next(r for r in caplog.records if getattr(r, "request_id", None) == resp.json()["id"])
    dispatch_s: float = line.dispatch_s  # type: ignore[attr-defined]
    assert dispatch_s >= tokenize_s
    assert line.ttft_s >= dispatch_s  # type: ignore[attr-defined]
    assert ttft_ms >= dispatch_s * 1000


# -- a client that goes away (a real server) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def billed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One engine slot decoding 20 tokens/s, a queue behind it, no shedding: a request can be made
    to wait for its first token by one that holds the slot."""
    env = {
        "SLUICE_DATA_DIR": str(tmp_path_factory.mktemp("billed")),
        "SLUICE_ADMIN_KEY": ADMIN_KEY,
        "SLUICE_USAGE_FLUSH_MS": "20",
    }
    yield from start_server(
        "--synthetic-tokens-per-second", "20", "--synthetic-ttft-ms", "1", "--max-num-seqs", "1",
        "--max-waiting", "4", "--no-load-shedding", auth=True, env=env,
    )


def server_tenant(server: Server) -> dict[str, str]:
    return make_tenant(lambda path, **kw: httpx.post(server.base_url + path, **kw))


def server_usage(server: Server, headers: dict[str, str], requests: int) -> dict[str, int]:
    return usage_of(lambda: httpx.get(f"{server.v1}/usage?group_by=model", headers=headers).json(), requests)


def wait_for(server: Server, what: Callable[[dict[str, Any]], bool]) -> None:
    deadline = time.monotonic() + 30
    while not what(server.stats()):
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.02)


def test_a_client_gone_mid_stream_is_charged_its_prompt_and_the_tokens_generated(billed_server: Server) -> None:
    wait_for(billed_server, lambda s: s["running"] == 0 and s["waiting"] == 0)
    headers = server_tenant(billed_server)
    body = {"prompt": "a b c", "max_tokens": 2_000, "stream": True}
    seen = 0
    with httpx.stream("POST", billed_server.v1 + "/completions", json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    usage = server_usage(billed_server, headers, requests=1)
    assert usage["prompt_tokens"] == 4
    # What the engine generated until the abort reached it: at least what was read, far from all.
    assert seen <= usage["completion_tokens"] < 2_000


def test_a_client_gone_before_its_first_token_is_not_charged(billed_server: Server) -> None:
    wait_for(billed_server, lambda s: s["running"] == 0 and s["waiting"] == 0)
    holder = server_tenant(billed_server)
    waiter = server_tenant(billed_server)
    hold = {"prompt": "x", "max_tokens": 2_000, "stream": True}
    with httpx.stream("POST", billed_server.v1 + "/completions", json=hold, headers=holder, timeout=60) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator would close the holder's stream
        assert resp.status_code == 200 and next(lines).startswith("data: ")
        url = urlsplit(billed_server.base_url)
        body = f'{{"prompt": "{BIG}", "max_tokens": 5}}'.encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {url.hostname}\r\ncontent-type: application/json\r\n"
            f"authorization: {waiter['authorization']}\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(head + body)
            wait_for(billed_server, lambda s: s["waiting"] == 1)  # in the engine, behind the holder
        # The socket is closed: the waiting request is aborted without ever producing a token.
        wait_for(billed_server, lambda s: s["waiting"] == 0)
    usage = server_usage(billed_server, waiter, requests=1)
    assert usage == {"requests": 1, "prompt_tokens": 0, "completion_tokens": 0}
