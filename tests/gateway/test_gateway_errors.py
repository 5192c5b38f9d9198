"""Every bad input gets the right status in OpenAI's error shape, and never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from gateway_server import MAX_BODY_BYTES, MAX_MODEL_LEN, Server

CHAT = "/chat/completions"
GOOD = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("body", "param", "mentions"),
    [
        ({"model": "synthetic"}, "messages", "messages"),
        ({**GOOD, "messages": [{"content": "x"}]}, "messages[0].role", "role"),
        ({"model": "synthetic", "messages": "hi"}, "messages", "array"),
        ({"model": "synthetic", "messages": []}, "messages", "length"),
        ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "content"),
        ({**GOOD, "max_tokens": "ten"}, "max_tokens", "int"),
        ({**GOOD, "max_tokens": 0}, "max_tokens", ">= 1"),
        ({**GOOD, "max_tokens": -3}, "max_tokens", ">= 1"),
        ({**GOOD, "temperature": -1}, "temperature", ">= 0"),
        ({**GOOD, "temperature": 2.5}, "temperature", "<= 2"),
        ({**GOOD, "top_p": 0}, "top_p", "> 0"),
        ({**GOOD, "n": 0}, "n", ">= 1"),
        ({**GOOD, "n": 9}, "n", "<= 8"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop", "length"),
        ({**GOOD, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "<= 20"),
        ({**GOOD, "top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({**GOOD, "stream": "yes"}, "stream", "bool"),
        ({**GOOD, "stream": True, "max_tokens": 0}, "max_tokens", ">= 1"),  # JSON error, not a 200 stream
    ],
)
def test_invalid_chat_bodies_are_400_naming_the_field(
    server: Server, body: dict[str, Any], param: str | None, mentions: str
) -> None:
    error = assert_error(httpx.post(server.v1 + CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert mentions in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "synthetic", "prompt": ["a", 1]}, "prompt"),
        ({"model": "synthetic", "prompt": [999999]}, "prompt"),
        ({"model": "synthetic", "prompt": []}, "prompt"),
        ({"model": "synthetic", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "synthetic"}, "prompt"),
    ],
)
def test_invalid_completion_bodies_are_400(server: Server, body: dict[str, Any], param: str | None) -> None:
    assert_error(httpx.post(server.v1 + "/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "raw", [b"{bad json", b"", b"[1, 2]", b"null", '{"messages": "\xff"}'.encode("latin-1")]
)
def test_malformed_json_is_400(server: Server, raw: bytes) -> None:
    resp = httpx.post(server.v1 + CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400)


def test_context_overflow_names_both_numbers(server: Server) -> None:
    error = assert_error(httpx.post(server.v1 + CHAT, json={**GOOD, "max_tokens": 600}), 400, "max_tokens")
    prompt_tokens = 1 + 1 + 1 + 1 + 1
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert (
        f"you requested {prompt_tokens + 600} tokens ({prompt_tokens} in the messages, 600 in the completion)"
        in (error["message"])
    )
    long_prompt = " ".join(["w"] * MAX_MODEL_LEN)
    error = assert_error(httpx.post(server.v1 + "/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert str(MAX_MODEL_LEN + 1) in error["message"]


def test_unknown_model_is_404(server: Server) -> None:
    error = assert_error(httpx.post(server.v1 + CHAT, json={**GOOD, "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)


def test_body_over_cap_is_413(server: Server) -> None:
    big = {**GOOD, "messages": [{"role": "user", "content": "x " * MAX_BODY_BYTES}]}
    error = assert_error(httpx.post(server.v1 + CHAT, json=big), 413)
    assert error["type"] == "request_too_large_error" and str(MAX_BODY_BYTES) in error["message"]

    # Without a content-length header (chunked upload) the cap is enforced on the bytes received.
    def chunks() -> Any:
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b" " * 1024

    assert_error(
        httpx.post(server.v1 + CHAT, content=chunks(), headers={"content-type": "application/json"}), 413
    )


def test_unknown_route_and_method(server: Server) -> None:
    error = assert_error(httpx.get(server.v1 + "/nope"), 404)
    assert "/v1/nope" in error["message"]
    assert_error(httpx.get(server.v1 + CHAT), 405)
    assert_error(httpx.delete(server.base_url + "/healthz"), 405)


def test_openai_client_raises_bad_request(server: Server) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": "x"}], max_tokens=10_000
        )
    assert info.value.status_code == 400
