"""The synthetic driver on its own: the contract the gateway relies on."""

from __future__ import annotations

import asyncio

import pytest

from drivers.base import ChatMessage, FinishReason, GenerationRequest, InvalidRequestError, OverloadedError
from drivers.options import EngineOptions
from drivers.registry import available_drivers, create_driver
from drivers.synthetic import SyntheticDriver


def req(rid: str, **kw: object) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="synthetic", **{"prompt": "a b c", **kw})  # type: ignore[arg-type]


async def collect(
    driver: SyntheticDriver, request: GenerationRequest
) -> tuple[str, FinishReason | None, int]:
    text, finish, tokens = "", None, 0
    async for chunk in driver.generate(request):
        text += chunk.text
        finish, tokens = chunk.finish_reason, chunk.completion_tokens
    return text, finish, tokens


def test_registry_creates_synthetic_without_importing_native() -> None:
    import sys

    assert {"synthetic", "native"} <= set(available_drivers())
    assert isinstance(create_driver("synthetic", EngineOptions(synthetic_tokens_per_second=0)), SyntheticDriver)
    assert "drivers.native" not in sys.modules or "torch" in sys.modules  # lazily imported only
    with pytest.raises(ValueError, match="unknown driver"):
        create_driver("nope")


def test_prompt_count_matches_generation_and_chat_template() -> None:
    driver = SyntheticDriver(tokens_per_second=0, ttft_s=0)
    chat = GenerationRequest(
        request_id="c", model="synthetic", messages=[ChatMessage("system", "x y"), ChatMessage("user", "z")]
    )
    assert len(asyncio.run(driver.tokenize(chat))) == 1 + (1 + 2 + 1) + (1 + 1 + 1) + 1
    assert len(asyncio.run(driver.tokenize(req("p")))) == 4

    async def main() -> int:
        await driver.start()
        async for chunk in driver.generate(req("p", max_tokens=1)):
            return chunk.prompt_tokens
        return -1

    assert asyncio.run(main()) == 4


def test_stop_string_text_never_leaks_past_the_cut() -> None:
    async def main() -> None:
        driver = SyntheticDriver(tokens_per_second=0, ttft_s=0)
        await driver.start()
        full, _, _ = await collect(driver, req("a", max_tokens=30, seed=11))
        for start in range(0, 40, 3):
            stop = full[start : start + 4]
            if stop.strip() != stop:
                continue
            text, finish, _ = await collect(driver, req(f"s{start}", max_tokens=30, seed=11, stop=[stop]))
            assert (text, finish) == (full[: full.index(stop)], FinishReason.STOP)

    asyncio.run(main())


def test_abort_and_overload() -> None:
    async def main() -> None:
        driver = SyntheticDriver(tokens_per_second=5, ttft_s=0, max_num_seqs=1, max_waiting=1)
        await driver.start()
        running = driver.generate(req("r1", max_tokens=100))
        assert (await anext(running)).text
        waiting = asyncio.ensure_future(collect(driver, req("r2", max_tokens=1)))
        await asyncio.sleep(0.01)
        health = await driver.health()
        assert (health.running, health.waiting) == (1, 1)
        with pytest.raises(OverloadedError) as info:
            await anext(driver.generate(req("r3")))
        assert info.value.retry_after >= 1
        await driver.abort("r1")
        last = [c async for c in running][-1]
        assert last.finish_reason == FinishReason.ABORT
        assert (await waiting)[1:] == (FinishReason.LENGTH, 1)  # the freed slot went to the waiter
        health = await driver.health()
        assert (health.running, health.waiting) == (0, 0)

    asyncio.run(main())


def test_closing_the_iterator_releases_the_slot() -> None:
    async def main() -> None:
        driver = SyntheticDriver(tokens_per_second=5, ttft_s=0, max_num_seqs=1, max_waiting=0)
        await driver.start()
        stream = driver.generate(req("x", max_tokens=100))
        await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        assert (await driver.health()).running == 0
        assert (await anext(driver.generate(req("y", max_tokens=1)))).finish_reason == FinishReason.LENGTH

    asyncio.run(main())


def test_context_and_token_id_validation() -> None:
    driver = SyntheticDriver(max_model_len=8)
    with pytest.raises(InvalidRequestError, match="maximum context length is 8"):
        asyncio.run(anext(driver.generate(req("a", max_tokens=6))))
    with pytest.raises(InvalidRequestError):
        asyncio.run(driver.tokenize(GenerationRequest(request_id="t", model="synthetic", prompt_token_ids=[-1])))
