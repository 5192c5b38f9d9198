"""A request's way through the gateway with the native engine and the bundled SmolLM2, in-process:
each prompt is tokenized once and off the event loop, and the tenant is charged compute done once
(docs/billing.md: the cases only the real engine shows, preemption and the engine's own refusal).

The tokenizer is the real one, wrapped to count its calls and to say when an encode is running.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
from litestar.testing import TestClient

from drivers.native import NativeDriver, NativeDriverConfig
from engine_native.model.tokenizer import Tokenizer
from gateway.app import create_app
from gateway.settings import Settings
from gateway.validation import MAX_BYTES_PER_TOKEN

MAX_MODEL_LEN = 8192  # the model's own: a ~1 MiB prompt passes the byte cap and is tokenized
KV_BLOCKS, BLOCK_SIZE = 16, 16  # 256 tokens of KV cache: four requests of 100 tokens cannot run at once
ADMIN = {"authorization": "Bearer native-lifecycle-admin"}


class CountingTokenizer:
    """The real tokenizer; counts encodes, notes the threads they run on and how many heartbeats
    (turns of a coroutine on the app's event loop, `beat()`) happened while each one ran."""

    def __init__(self, real: Tokenizer) -> None:
        self.real = real
        self.encodes = 0
        self.threads: list[int] = []
        self.heartbeats = 0
        self.heartbeats_during: list[int] = []  # per encode

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        self.threads.append(threading.get_ident())
        before = self.heartbeats
        try:
            return self.real.encode(text, add_special_tokens)
        finally:
            self.heartbeats_during.append(self.heartbeats - before)


class Native:
    def __init__(self, client: TestClient[Any], driver: NativeDriver, tokenizer: CountingTokenizer) -> None:
        self.client = client
        self.driver = driver
        self.tokenizer = tokenizer

    def tenant(self, **limits: Any) -> tuple[str, dict[str, str]]:
        body = {"name": f"t-{uuid.uuid4().hex[:8]}", "max_concurrent": None, **limits}
        tenant = self.client.post("/admin/tenants", json=body, headers=ADMIN)
        assert tenant.status_code == 201, tenant.text
        tid = tenant.json()["id"]
        key = self.client.post(f"/admin/tenants/{tid}/keys", json={"name": "k"}, headers=ADMIN)
        assert key.status_code == 201, key.text
        return tid, {"authorization": f"Bearer {key.json()['key']}"}

    def usage(self, headers: dict[str, str], requests: int) -> dict[str, int]:
        """The tenant's usage once `requests` records are written (they are written off the request path)."""
        deadline = time.monotonic() + 60
        while True:
            data = self.client.get("/v1/usage?group_by=model", headers=headers).json()["data"]
            if sum(b["requests"] for b in data) >= requests:
                return {k: sum(b[k] for b in data) for k in ("requests", "prompt_tokens", "completion_tokens")}
            assert time.monotonic() < deadline, data
            time.sleep(0.05)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Native]:
    engine = NativeDriverConfig().engine
    driver = NativeDriver(NativeDriverConfig(
        engine=replace(
            engine, max_model_len=MAX_MODEL_LEN, num_threads=1,
            cache=replace(engine.cache, num_blocks=KV_BLOCKS, block_size=BLOCK_SIZE),
            scheduler=replace(engine.scheduler, max_num_seqs=4),
        ),
        progress=False,
    ))
    settings = Settings(
        data_dir=str(tmp_path_factory.mktemp("native-lifecycle")), admin_key=ADMIN["authorization"].split()[1],
        usage_flush_interval_s=0.02, max_body_bytes=4 << 20,
    )
    with TestClient(create_app(settings, driver), timeout=300) as client:
        deadline = time.monotonic() + 300
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the native engine did not start"
            time.sleep(0.2)
        assert driver.tokenizer is not None
        counting = CountingTokenizer(driver.tokenizer)
        driver.tokenizer = counting
        yield Native(client, driver, counting)


def test_each_distinct_prompt_is_tokenized_once_whatever_n(native: Native) -> None:
    _, headers = native.tenant()
    before = native.tokenizer.encodes
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 2, "n": 3}
    resp = native.client.post("/v1/chat/completions", json=chat, headers=headers)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 3
    assert native.tokenizer.encodes - before == 1
    before = native.tokenizer.encodes
    batch = {"prompt": ["One, two,", "Red, green,"], "max_tokens": 2, "n": 3}
    resp = native.client.post("/v1/completions", json=batch, headers=headers)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 6
    assert native.tokenizer.encodes - before == 2


def test_a_one_mib_prompt_is_tokenized_while_the_event_loop_keeps_running(native: Native) -> None:
    _, headers = native.tenant()
    content = "hello world " * 87_000  # 1,044,000 characters: under the byte cap, ~174,000 tokens
    assert len(content) <= MAX_MODEL_LEN * MAX_BYTES_PER_TOKEN
    tokenizer = native.tokenizer
    done = threading.Event()

    async def heartbeat() -> int:
        """Beats on the app's event loop until the request is answered; returns the loop's thread."""
        while not done.is_set():
            tokenizer.heartbeats += 1
            await asyncio.sleep(0.001)  # one beat per wake-up: it gives the GIL back in between
        return threading.get_ident()

    loop_thread = native.client.blocking_portal.start_task_soon(heartbeat)
    before = tokenizer.encodes
    try:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        resp = native.client.post("/v1/chat/completions", json=body, headers=headers)
    finally:
        done.set()
    assert resp.status_code == 400 and " in the messages" in resp.json()["error"]["message"], resp.text
    assert tokenizer.encodes - before == 1
    assert tokenizer.threads[-1] != loop_thread.result(timeout=60)  # never on the event loop's thread
    # And the loop really turns meanwhile, beat after beat (~250 here). A tokenizer that held the GIL
    # through its encode lets through only the few beats its Python-side work switches to (~5 here);
    # run on the loop's thread, none.
    assert tokenizer.heartbeats_during[-1] >= 50, tokenizer.heartbeats_during


def test_a_prompt_too_long_for_any_tokenization_is_refused_without_tokenizing(native: Native) -> None:
    _, headers = native.tenant()
    before = native.tokenizer.encodes
    content = "x" * (MAX_MODEL_LEN * MAX_BYTES_PER_TOKEN + 1)
    resp = native.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]}, headers=headers
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages"
    assert native.tokenizer.encodes == before


def test_preempted_and_recomputed_requests_are_charged_once(native: Native) -> None:
    _, headers = native.tenant()
    preemptions_before = native.client.get("/v1/engine/stats").json()["preemptions"]
    body = {"prompt": "Count from one to one hundred: one, two, three,", "max_tokens": 80,
            "ignore_eos": True, "temperature": 0}

    def one(_: int) -> dict[str, int]:
        resp = native.client.post("/v1/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        usage: dict[str, int] = resp.json()["usage"]
        return usage

    with ThreadPoolExecutor(4) as pool:
        reported = list(pool.map(one, range(4)))
    # Four requests of ~100 tokens in a 256-token cache: some were preempted and recomputed (the
    # engine's figures reach the gateway a moment later).
    deadline = time.monotonic() + 60
    while native.client.get("/v1/engine/stats").json()["preemptions"] <= preemptions_before:
        assert time.monotonic() < deadline, "no request was preempted"
        time.sleep(0.1)
    assert all(u["completion_tokens"] == 80 for u in reported)
    usage = native.usage(headers, requests=4)
    assert usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in reported)
    assert usage["completion_tokens"] == 4 * 80


def test_a_request_the_engine_refuses_is_not_charged(native: Native) -> None:
    _, headers = native.tenant(tokens_per_minute=10_000)
    # Fits the context, not the 256-token KV cache: refused (400) before it is queued, since it could never run.
    body = {"prompt": "story " * 2000, "max_tokens": 1}
    refused = native.client.post("/v1/completions", json=body, headers=headers)
    assert refused.status_code == 400, refused.text
    assert native.usage(headers, requests=1) == {"requests": 1, "prompt_tokens": 0, "completion_tokens": 0}
    # Its reservation went back in full: the next request sees the whole bucket minus its own.
    ok = native.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
    assert ok.status_code == 200, ok.text
    reserved = ok.json()["usage"]["prompt_tokens"] + 1
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) >= 10_000 - reserved
