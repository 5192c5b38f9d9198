"""The lifetime cap over a request's chunks (gateway/fanout.py): one timer a request, which cuts a
stream that waits past it, never a consumer busy between chunks, and never turns another cancel into
a timeout. Over the synthetic driver, whose requests really run (and are aborted) on the loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from drivers.base import GenerationRequest
from drivers.synthetic import SyntheticDriver
from gateway.fanout import Fanout, LifetimeExceededError


async def _opened(tokens_per_second: float, cap_s: float, n: int = 1,
                  max_tokens: int = 200) -> tuple[SyntheticDriver, Fanout]:
    """A started synthetic driver and an opened fanout of `n` choices whose lifetime ends in `cap_s`."""
    driver = SyntheticDriver(tokens_per_second=tokens_per_second, ttft_s=0)
    await driver.start()
    requests = [GenerationRequest(request_id=f"r{i}", model="synthetic", prompt="hi", max_tokens=max_tokens)
                for i in range(n)]
    fanout = Fanout(driver, requests, deadline=asyncio.get_running_loop().time() + cap_s)
    await fanout.open()
    return driver, fanout


async def _running(driver: SyntheticDriver) -> int:
    await asyncio.sleep(0.05)  # the aborts land on the driver's next wake-up
    return (await driver.health()).running


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_past_its_lifetime_is_cut_and_its_requests_aborted(n: int) -> None:
    async def main() -> None:
        began = time.monotonic()  # the cap counts from just after this
        driver, fanout = await _opened(tokens_per_second=20, cap_s=0.3, n=n)
        got = 0
        with pytest.raises(LifetimeExceededError):
            async for _ in fanout.chunks():
                got += 1
        took = time.monotonic() - began
        await fanout.aclose()
        assert 0.29 < took < 5.0, took  # cut at the cap (not before it) and long before 200 tokens take (10 s)
        assert n <= got < 200 * n
        assert await _running(driver) == 0

    asyncio.run(main())


def test_a_consumer_busy_past_the_deadline_is_not_cancelled_its_next_wait_raises() -> None:
    async def main() -> None:
        driver, fanout = await _opened(tokens_per_second=100, cap_s=0.2)
        chunks = fanout.chunks()
        await anext(chunks)
        await asyncio.sleep(0.4)  # e.g. writing to a slow client: the deadline passes meanwhile
        with pytest.raises(LifetimeExceededError):
            await anext(chunks)
        await fanout.aclose()
        assert await _running(driver) == 0

    asyncio.run(main())


def test_another_cancel_stays_a_cancel_and_a_closed_fanout_cancels_nothing_later() -> None:
    async def main() -> None:
        driver, fanout = await _opened(tokens_per_second=5, cap_s=0.3)

        async def consume() -> None:
            async for _ in fanout.chunks():
                pass

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        consumer.cancel()  # the client left, before the cap
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await fanout.aclose()
        assert await _running(driver) == 0

        # The cap's timer went with the fanout: a task that outlives the deadline is left alone.
        async def outlive() -> str:
            await asyncio.sleep(0.5)
            return "done"

        assert await asyncio.create_task(outlive()) == "done"

    asyncio.run(main())


def test_a_lifetime_that_never_comes_costs_one_timer_not_one_per_chunk() -> None:
    async def main() -> None:
        _, fanout = await _opened(tokens_per_second=0, cap_s=60, max_tokens=300)  # as fast as the loop allows
        loop = asyncio.get_running_loop()
        timers = 0
        call_at = loop.call_at

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal timers
            timers += 1
            return call_at(*args, **kwargs)

        loop.call_at = counted  # type: ignore[method-assign]
        try:
            got = [chunk async for _, chunk in fanout.chunks()]
        finally:
            loop.call_at = call_at  # type: ignore[method-assign]
        await fanout.aclose()
        assert got[-1].finish_reason is not None and got[-1].completion_tokens == 300
        assert timers == 1

    asyncio.run(main())
