"""The driver against a real SGLang server, opt-in: skipped unless SLUICE_SGLANG_URL names one
(docs/sglang.md says how to start it). Run: SLUICE_SGLANG_URL=http://host:30000 pytest tests/sglang/test_sglang_real.py
The same properties as the stand-in tests, on real output: greedy streams repeat, stop strings are cut,
one logprob per token, the radix cache shows in cached_tokens, a closed stream frees the server, a
prompt beyond the context is a 400."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import pytest
from driver_session import with_driver

from drivers.base import FinishReason, GenerationChunk, GenerationRequest, InvalidRequestError
from drivers.sglang.config import SGLangConfig
from drivers.sglang.driver import SGLangDriver
from tests.polling import await_until

URL = os.environ.get("SLUICE_SGLANG_URL")
pytestmark = pytest.mark.skipif(not URL, reason="SLUICE_SGLANG_URL names no SGLang server")
T = TypeVar("T")


def run(body: Callable[[SGLangDriver], Awaitable[T]]) -> T:
    return with_driver(SGLangConfig(servers=(URL or "",), api_key=os.environ.get("SLUICE_SGLANG_API_KEY")), body)


async def ask(driver: SGLangDriver, rid: str, max_tokens: int = 24, **fields: object) -> list[GenerationChunk]:
    model = driver.models()[0].id
    req = GenerationRequest(request_id=rid, model=model, prompt="The capital of France is", max_tokens=max_tokens,
                            temperature=0.0, **fields)  # type: ignore[arg-type]
    ids = await driver.tokenize(req)
    req = GenerationRequest(**{**{f: getattr(req, f) for f in req.__struct_fields__}, "tokenized_prompt": ids})
    return [c async for c in driver.generate(req)]


def test_real_server_streams_stops_logprobs_cache_abort_and_errors() -> None:
    async def body(driver: SGLangDriver) -> None:
        first = await ask(driver, "real-1")
        again = await ask(driver, "real-2")
        ids = [t for c in first for t in c.token_ids]
        assert ids == [t for c in again for t in c.token_ids] and len(ids) == first[-1].completion_tokens
        assert (again[-1].cached_tokens or 0) > 0
        text = "".join(c.text for c in first)
        if len(text) > 12:
            stop = text[6:10]
            cut = await ask(driver, "real-3", stop=[stop])
            assert "".join(c.text for c in cut) == text[: text.index(stop)]
            assert cut[-1].finish_reason is FinishReason.STOP
        scored = await ask(driver, "real-4", max_tokens=6, logprobs=2)
        logprobs = [lp for c in scored for lp in c.logprobs or []]
        assert len(logprobs) == scored[-1].completion_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)

        stream = driver.generate(GenerationRequest(
            request_id="real-5", model=driver.models()[0].id, prompt_token_ids=ids, tokenized_prompt=ids,
            max_tokens=2000, ignore_eos=True))
        async with contextlib.aclosing(stream):
            await anext(stream)

        async def idle() -> bool:
            async with httpx.AsyncClient() as http:
                load = (await http.get(f"{URL}/get_load")).json()
            ranks = load if isinstance(load, list) else [load]
            return all(not r.get("num_reqs", r.get("load", 0)) for r in ranks)
        await await_until(idle, "the server let go of the closed request", timeout_s=30)

        limit = driver.models()[0].max_model_len
        with pytest.raises(InvalidRequestError):
            too_long = list(ids) * (limit // max(1, len(ids)) + 2)
            [c async for c in driver.generate(GenerationRequest(
                request_id="real-6", model=driver.models()[0].id, prompt_token_ids=too_long,
                tokenized_prompt=too_long, max_tokens=4))]
    run(body)
