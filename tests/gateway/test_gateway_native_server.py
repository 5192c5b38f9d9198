"""The real thing: `sluice serve` with the native engine and the bundled SmolLM2, driven over HTTP
by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
from gateway_server import Server, engine_pids, start_server

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def native() -> Iterator[Server]:
    yield from start_server(
        "--driver", "native", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
        "--kv-cache-memory", "256MiB", "--num-threads", "2", startup_timeout_s=240,
    )


@pytest.fixture()
def client(native: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=native.v1, api_key="unused", max_retries=0)


def test_models_and_readiness(native: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{native.base_url}/readyz").status_code == 200
    stats = native.stats()
    assert stats["kv_blocks_total"] > 0 and stats["ready"] is True


def test_chat_answers_the_capital_of_france(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        max_tokens=40,
    )
    choice = resp.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streamed_completion_matches_the_unstreamed_one_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_string_and_logprobs(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0)
    full = base.choices[0].text
    stop = full.strip()[:3]
    assert stop
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_every_token_gets_its_event_while_its_text_is_held_back(client: openai.OpenAI) -> None:
    # A stop string that the whole output is a prefix of holds every token's text back until the
    # end; each token still gets its event (empty text), as vLLM's server sends one, so a client's
    # inter-token times are the engine's and not a multiple of them.
    kwargs = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    held = {**kwargs, "stop": [full + "\u00a7"]}  # never completed: the output ends by length
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **held))
    events = [c.choices[0] for c in chunks if c.choices]
    assert len(events) == 12 == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
    assert [e.text for e in events[:-1]] == [""] * 11  # held back while the stop string might form
    assert events[-1].text == full and events[-1].finish_reason == "length"
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8, temperature=0,
        stop=["\u00a7 never"], stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ))
    deltas = [c.choices[0].delta for c in chat if c.choices]
    assert len(deltas) == 1 + 8 == 1 + chat[-1].usage.completion_tokens  # type: ignore[union-attr]  # role first


def test_bad_inputs_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello " * 900, max_tokens=500)
    message = str(too_long.value)
    assert str(MAX_MODEL_LEN) in message and "500" in message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[999_999], max_tokens=2)  # token id outside the vocab
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(model=MODEL, prompt="", max_tokens=2)  # SmolLM2 adds no BOS: no tokens at all
    assert empty.value.param == "prompt"


def test_cached_prompt_tokens_count_each_prompt_of_a_batch_once(client: openai.OpenAI) -> None:
    """usage.prompt_tokens_details.cached_tokens counts what the prefix cache served of each prompt, as
    prompt_tokens counts each prompt: summed over a batch's prompts (it took the largest of them), once for
    the n choices that share one."""
    shared = "Sluice keeps a paged KV cache and serves identical prefixes from it. " * 4
    client.completions.create(model=MODEL, prompt=shared, max_tokens=1)  # its blocks are cached from here on
    alone = client.completions.create(model=MODEL, prompt=shared, max_tokens=1).usage
    assert alone.prompt_tokens_details is not None
    cached = alone.prompt_tokens_details.cached_tokens
    assert cached >= 16
    batch = client.completions.create(model=MODEL, prompt=[shared, shared], max_tokens=1).usage
    assert batch.prompt_tokens == 2 * alone.prompt_tokens
    assert batch.prompt_tokens_details is not None and batch.prompt_tokens_details.cached_tokens == 2 * cached
    choices = client.completions.create(model=MODEL, prompt=shared, max_tokens=1, n=2).usage
    assert choices.prompt_tokens_details is not None and choices.prompt_tokens_details.cached_tokens == cached


def test_streamed_text_offsets_equal_the_whole_answers(client: openai.OpenAI) -> None:
    """A completion's logprobs.text_offset is the same streamed as whole, also where the stream held text back
    (here " 3, 4, 5, " may begin the stop string and is sent only once "6" rules it out)."""
    args = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 12, "temperature": 0, "logprobs": 1,
            "stop": [" 3, 4, 5, X"]}
    whole = client.completions.create(**args).choices[0]
    assert whole.text.startswith(" 3, 4, 5, 6") and whole.logprobs is not None
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in client.completions.create(**args, stream=True):
        logprobs = chunk.choices[0].logprobs if chunk.choices else None
        if logprobs is not None:
            tokens += logprobs.tokens or []
            offsets += logprobs.text_offset or []
    assert tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI) -> None:
    """OpenAI's logit_bias reaches the engine's sampler: +100 all but forces a token, -100 bans the one greedy
    decoding would pick; an id outside the vocabulary is a 400."""
    from engine_native.model.bundled import bundled_model_path
    from engine_native.model.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(bundled_model_path())
    assert tok is not None
    prompt = "The capital of France is"
    forced = tok.encode("banana", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == tok.decode([forced] * 3)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    banned = tok.encode(first, add_special_tokens=False)
    assert len(banned) == 1  # the greedy first token, whole
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      logit_bias={str(banned[0]): -100}).choices[0].text
    assert other != first
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logit_bias={"10000000": 5})
    assert "logit_bias" in str(outside.value)


def test_logprobs_bytes_are_the_tokens_own_bytes(client: openai.OpenAI) -> None:
    """A token holding part of a UTF-8 character decodes alone to U+FFFD; its logprob's `bytes` are its own
    (they join back into the text), not U+FFFD's three. The token is forced with logit_bias."""
    from engine_native.model.bundled import bundled_model_path
    from engine_native.model.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(bundled_model_path())
    assert tok is not None
    partial = next(i for i in tok.encode("日本語", add_special_tokens=False) if tok.decode([i]) == "\ufffd")
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=1,
                                         logprobs=True, top_logprobs=2, logit_bias={str(partial): 100})
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.content is not None
    (entry,) = out.choices[0].logprobs.content
    assert entry.bytes is not None and entry.bytes != [0xEF, 0xBF, 0xBD]
    assert bytes(entry.bytes) in "日本語".encode() and len(entry.bytes) >= 1


def test_integers_past_64_bits_are_400_not_a_crash_of_the_engine_pipe(native: Server) -> None:
    """msgpack carries integers below 2**64 only: such a seed or token id once made a 500 here."""
    url = native.v1 + "/completions"
    for body, param in (
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "seed": 2**63, "n": 2}, "seed"),
        ({"prompt": [2**64]}, "prompt[0]"),
        ({"prompt": [[1, 2**70]]}, "prompt[0][1]"),
    ):
        resp = httpx.post(url, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
    # The largest seed still serves every choice: choice i samples with seed + i.
    resp = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 3},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 3


def test_disconnect_mid_stream_frees_the_kv_blocks(native: Server) -> None:
    idle = native.wait_idle()
    assert idle["kv_blocks_used"] == 0
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 600, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{native.v1}/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: "):
                received += 1
            if received == 5:
                break
        # The engine sends its stats at most every 100 ms (engine_native/process.py): wait for the snapshot
        # that shows the stream running, with the stream still open.
        deadline = time.monotonic() + 5
        busy = native.stats()
        while not busy["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
            busy = native.stats()
        assert busy["running"] == 1 and busy["kv_blocks_used"] > 0
    # The client is gone: the engine must abort the request and free its blocks promptly.
    deadline = time.monotonic() + 5
    stats = native.stats()
    while (stats["kv_blocks_used"] or stats["running"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = native.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


def test_fifty_concurrent_streams_all_finish_with_the_right_length(native: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request {i}: tell me about the number {i}.", max_tokens=12, temperature=0.7,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        pieces, usage, finish = 0, 0, None
        async for chunk in stream:
            if chunk.choices:
                pieces += 1
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return pieces, usage, finish

    async def main() -> list[tuple[int, int, str | None]]:
        client = openai.AsyncOpenAI(base_url=native.v1, api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(usage == 12 and finish == "length" and pieces >= 1 for pieces, usage, finish in results), results
    assert native.wait_idle(10)["kv_blocks_used"] == 0


def test_a_client_gone_before_a_non_streamed_answer_aborts_it(native: Server) -> None:
    import json
    import socket
    from urllib.parse import urlsplit

    assert native.wait_idle()["kv_blocks_used"] == 0
    url = urlsplit(native.base_url)
    body = json.dumps({"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 900,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {url.hostname}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while native.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert native.stats()["running"] == 1  # generating, nothing sent yet
    # The socket is closed long before 900 tokens could be made: the request must be aborted.
    deadline = time.monotonic() + 5
    stats = native.stats()
    while (stats["running"] or stats["kv_blocks_used"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = native.stats()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_the_gateway_process_tokenizes_and_sizes_the_model_without_torch(native: Server, client: openai.OpenAI) -> None:
    """torch and the weights live in the engine's process only: the gateway reads the tokenizer and the
    model's size from the file's header (engine_native/model/tokenizer_loader.py, inspect.py), so its own
    process never maps libtorch (~200 MB and ~1.6 s of a start)."""
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert native.stats()["ready"] is True  # its size was read while it loaded (drivers/versioned.py, start)
    maps = Path(f"/proc/{native.process.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "tokenizers" in maps  # the process the test reads is the one that tokenizes


def test_the_server_answers_while_the_model_loads() -> None:
    """Alive (healthz 200) at once, ready (readyz 200) only once loaded; a request sent meanwhile is a
    cold start (gateway/cold_start.py): held, then served once the model is ready, or 503 + Retry-After
    past the hold's bound or deadline, never an error or a hang."""
    import socket
    import subprocess

    from gateway_server import SLUICE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([SLUICE, "serve", "--driver", "native", "--no-auth", "--port", str(port),
                             "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        seen_loading = False
        while time.monotonic() < deadline:
            try:
                alive = httpx.get(f"{base}/healthz", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            assert alive.status_code == 200
            ready = httpx.get(f"{base}/readyz", timeout=1)
            if ready.status_code == 200:
                break
            seen_loading = True
            early = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               timeout=120)  # only catches a hang: the hold's own deadline is 60 s
            assert early.status_code in (200, 503), early.text
            if early.status_code == 503:
                assert early.headers["retry-after"]
            time.sleep(0.1)
        assert seen_loading, "the server only listened once the model was loaded"
        ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)  # a drain and the engine's exit, on a 2-core host busy with other tests' servers


def test_the_engine_loads_the_model_while_the_gateway_imports() -> None:
    """`sluice serve` spawns the engine process before it imports the gateway (its web framework, stores and
    metrics, ~1.5 s; gateway/cli.py): the engine process is older than the gateway's "starting" line, which
    the gateway logs once its app is built."""
    from benchmarks.server_process import ServerProcess

    with ServerProcess(["--driver", "native", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                        "--log-level", "INFO"], startup_timeout_s=240) as server:
        assert server.process is not None
        starting = next(json.loads(line)["ts"] for line in server.log_tail(100_000).splitlines()
                        if line.startswith("{") and json.loads(line).get("msg") == "starting")
        logged = datetime.fromisoformat(starting).timestamp()
        engine = engine_pids(server.process.pid)[0]
        assert _started_at(engine) < logged - 0.2, (_started_at(engine), logged)


def _started_at(pid: int) -> float:
    """A process's start, in seconds since the epoch (/proc: clock ticks since boot; /proc/stat's boot time
    is whole seconds, so the boot is placed from the uptime instead)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
