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


COMPLETION = {"model": "synthetic", "prompt": "hi"}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, {**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        (CHAT, {**GOOD, "tool_choice": "required"}, "tool_choice"),
        (CHAT, {**GOOD, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (CHAT, {**GOOD, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
        (CHAT, {**GOOD, "function_call": {"name": "f"}}, "function_call"),
        (CHAT, {**GOOD, "response_format": {"type": "json_object"}}, "response_format"),
        (CHAT, {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/completions", {**COMPLETION, "best_of": 3}, "best_of"),
        (CHAT, {**GOOD, "logit_bias": {"the": 5}}, "logit_bias"),
        ("/completions", {**COMPLETION, "logit_bias": {"-7": 5}}, "logit_bias"),
        ("/completions", {**COMPLETION, "logit_bias": {"99999999999": 5}}, "logit_bias"),
        ("/completions", {**COMPLETION, "logit_bias": {"9" * 5000: 5}}, "logit_bias"),  # past int()'s 4,300 digits
        ("/completions", {**COMPLETION, "response_format": {"type": "json_schema"}}, "response_format"),
        ("/completions", {**COMPLETION, "echo": True}, "echo"),
        (CHAT, {**GOOD, "model": ""}, "model"),
    ],
)
def test_options_that_are_not_implemented_are_400_not_ignored(
    server: Server, route: str, body: dict[str, Any], param: str
) -> None:
    """An OpenAI option that would change the answer and that Sluice does not implement is refused, naming
    it; answering as if it had not been sent (plain text for a tool call, no JSON mode) misleads clients.
    So are a logit_bias key that is not a token id and an empty model name (it served the default model)."""
    error = assert_error(httpx.post(server.v1 + route, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_a_logit_bias_value_out_of_range_is_400(server: Server) -> None:
    """Values lie in [-100, 100], as OpenAI's; the decoder names the field."""
    for value in (101, -100.5):
        error = assert_error(httpx.post(server.v1 + CHAT, json={**GOOD, "logit_bias": {"5": value}}), 400)
        assert error["param"].startswith("logit_bias") and "100" in error["message"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (CHAT, {**GOOD, "n": None, "stream": None, "logprobs": None, "ignore_eos": None, "top_logprobs": None,
                "temperature": None, "stop": None, "seed": None, "user": None, "max_tokens": 3}),
        (CHAT, {**GOOD, "tools": [], "tool_choice": "none", "functions": None, "function_call": "auto",
                "response_format": {"type": "text"}, "logit_bias": {}, "max_tokens": 3}),
        (CHAT, {**GOOD, "stream": True, "stream_options": {"include_usage": None}, "max_tokens": 3}),
        ("/completions", {**COMPLETION, "echo": None, "best_of": None, "n": None, "suffix": None, "max_tokens": 3}),
        ("/completions", {**COMPLETION, "best_of": 2, "n": 2, "echo": False, "logit_bias": None, "max_tokens": 3}),
    ],
)
def test_null_and_no_op_values_of_optional_fields_are_their_defaults(
    server: Server, route: str, body: dict[str, Any]
) -> None:
    """OpenAI's optional fields take null for their default, and clients that serialize every key send it."""
    resp = httpx.post(server.v1 + route, json=body)
    assert resp.status_code == 200, resp.text
    if body.get("stream"):
        assert resp.text.rstrip().endswith("data: [DONE]") and '"usage"' not in resp.text
    else:
        assert len(resp.json()["choices"]) == (body.get("n") or 1)


def test_a_completion_without_max_tokens_gets_openais_default_of_16(server: Server) -> None:
    """The legacy completions API stops at 16 tokens when max_tokens is omitted (OpenAI's default, and
    vLLM's); chat runs on up to the context."""
    resp = httpx.post(server.v1 + "/completions", json={**COMPLETION, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
    chat = httpx.post(server.v1 + CHAT, json={**GOOD, "ignore_eos": True}, timeout=60).json()
    assert chat["usage"]["completion_tokens"] > 16


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
