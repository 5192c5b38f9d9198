"""The gateway through the official `openai` client: happy paths, sync and async, streamed or not."""

from __future__ import annotations

import asyncio

import openai
import pytest
from gateway_server import Server
from openai.types.chat import ChatCompletionMessageParam

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "tell me a story"},
]
# Synthetic chat template: BOS + per message (role + words + EOT) + assistant marker.
PROMPT_TOKENS = 1 + (1 + 2 + 1) + (1 + 4 + 1) + 1


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_chat_completion(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="synthetic", messages=MESSAGES, max_tokens=7)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-") and len(resp.id) == len("chatcmpl-") + 32
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert len((choice.message.content or "").split()) == 7
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        PROMPT_TOKENS,
        7,
        PROMPT_TOKENS + 7,
    )


def test_model_may_be_omitted_and_content_parts_accepted(server: Server) -> None:
    import httpx

    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}
        ],
        "max_completion_tokens": 3,
        "unknown_field": {"ignored": True},
    }
    resp = httpx.post(f"{server.v1}/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "synthetic"
    assert resp.json()["usage"]["prompt_tokens"] == 1 + 1 + 3 + 1 + 1
    assert resp.headers["x-request-id"] == resp.json()["id"]


def test_text_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="synthetic", prompt="one two three", max_tokens=5)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert len(resp.choices[0].text.split()) == 5
    assert resp.usage is not None and resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 5


def test_completion_with_token_ids_and_batch(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="synthetic", prompt=[10, 11, 12], max_tokens=2)
    assert resp.usage is not None and resp.usage.prompt_tokens == 4
    batch = client.completions.create(model="synthetic", prompt=["a", "b c"], max_tokens=2, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert (
        batch.usage is not None and batch.usage.prompt_tokens == 2 + 3 and batch.usage.completion_tokens == 8
    )


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="synthetic",
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (PROMPT_TOKENS, 12)
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="synthetic", prompt="x", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks).count(" ") == 5
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_stop_strings_cut_output_streamed_or_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model="synthetic", prompt="p", max_tokens=20, seed=7).choices[0].text
    words = full.split()
    single = words[4]
    spanning = full[full.index(words[6]) + 2 : full.index(words[7]) + 2]  # crosses a space
    for stop in (single, spanning):
        cut = full[: full.index(stop)]
        resp = client.completions.create(
            model="synthetic", prompt="p", max_tokens=20, seed=7, stop=[stop, "zzzzz"]
        )
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == (cut, "stop")
        chunks = list(
            client.completions.create(
                model="synthetic", prompt="p", max_tokens=20, seed=7, stop=stop, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_determinism_and_n(client: openai.OpenAI) -> None:
    def ask(seed: int | None, n: int = 1, temperature: float = 1.0) -> list[str]:
        resp = client.chat.completions.create(
            model="synthetic", messages=MESSAGES, max_tokens=8, seed=seed, n=n, temperature=temperature
        )
        return [c.message.content or "" for c in sorted(resp.choices, key=lambda c: c.index)]

    assert ask(1) == ask(1)
    assert ask(1) != ask(2)
    assert ask(None, temperature=0) == ask(None, temperature=0)
    pair = ask(5, n=2)
    assert len(pair) == 2 and pair[0] != pair[1]
    assert pair[0] == ask(5)[0]  # choice i uses seed + i
    assert pair[1] == ask(6)[0]


def test_n2_streaming_indexes_both_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="synthetic",
            messages=MESSAGES,
            max_tokens=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(len(t.split()) == 5 for t in texts.values())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="synthetic", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert " ".join(t.token for t in content) == resp.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="synthetic", prompt="hi", max_tokens=3, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["synthetic"]
    assert models.data[0].object == "model"


def test_async_client_streaming(server: Server) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="synthetic", messages=MESSAGES, max_tokens=4, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        full = await client.chat.completions.create(model="synthetic", messages=MESSAGES, max_tokens=4)
        await client.close()
        return ["".join(parts), full.choices[0].message.content or ""]

    streamed, whole = asyncio.run(main())
    assert len(streamed.split()) == 4 and len(whole.split()) == 4
