"""The worker's generate pump (worker/stream.py) over the synthetic engine, in-process: frames carry
every token that was ready, in order, with one engine time per token; held frames (interval) merge
tokens without losing or repeating one; the gateway's client-side decode reads them back."""

from __future__ import annotations

import asyncio
from typing import Any

from drivers.base import GenerationRequest
from drivers.fleet import wire
from drivers.synthetic import SyntheticDriver
from worker.app import refusal
from worker.stream import TokenStream


async def _pump(interval_s: float, tokens_per_second: float, max_tokens: int) -> tuple[list[wire.TokensEvent], str]:
    driver = SyntheticDriver(tokens_per_second=tokens_per_second, ttft_s=0)
    await driver.start()
    try:
        request = GenerationRequest(request_id="r", model="synthetic", prompt="one two three", max_tokens=max_tokens,
                                    temperature=0)
        chunks = aiter(driver.generate(request))
        first = asyncio.ensure_future(anext(chunks, None))
        bodies: list[bytes] = []
        gone = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            bodies.append(message.get("body", b""))

        async def receive() -> dict[str, Any]:
            await gone.wait()  # the gateway stays connected
            return {"type": "http.disconnect"}

        pump = TokenStream(first, chunks, send, receive, lambda exc: refusal(exc).body, deadline=None,
                           keepalive_s=5.0, interval_s=interval_s)
        outcome = await pump.run()
        events = wire.STREAM_DECODER.decode_lines(b"".join(bodies))
        tokens = [e for e in events if isinstance(e, wire.TokensEvent)]
        assert pump.frames_sent == len(tokens) and pump.tokens_sent == max_tokens
        return tokens, outcome
    finally:
        await driver.stop()


async def _direct(max_tokens: int) -> str:
    driver = SyntheticDriver(tokens_per_second=0, ttft_s=0)
    await driver.start()
    request = GenerationRequest(request_id="d", model="synthetic", prompt="one two three", max_tokens=max_tokens,
                                temperature=0)
    text = "".join([c.text async for c in driver.generate(request)])
    await driver.stop()
    return text


def test_held_frames_merge_tokens_in_order_with_a_time_each() -> None:
    events, outcome = asyncio.run(_pump(interval_s=0.05, tokens_per_second=200, max_tokens=30))
    assert outcome == "finished"
    assert len(events) < 30  # several tokens a frame (200 tokens/s, a frame per 50 ms)
    assert "".join(e.text for e in events) == asyncio.run(_direct(30))
    assert sum(len(e.token_ids) for e in events) == 30
    for e in events:
        assert len(e.token_times) == len(e.token_ids)
    assert [e.completion_tokens for e in events] == sorted(e.completion_tokens for e in events)
    assert events[-1].completion_tokens == 30 and events[-1].finish_reason == "length"
    times = [t for e in events for t in e.token_times]
    assert times == sorted(times)


def test_without_an_interval_every_frame_goes_out_when_written() -> None:
    events, outcome = asyncio.run(_pump(interval_s=0.0, tokens_per_second=100, max_tokens=10))
    assert outcome == "finished"
    assert "".join(e.text for e in events) == asyncio.run(_direct(10))
    assert sum(len(e.token_ids) for e in events) == 10
