"""An idle engine holds its first step for the rest of a burst the driver says is coming (AddRequest.more_coming,
SchedulerConfig.burst_hold_s), so that the burst is prefilled in one step and none of its requests has its first
inter-token gap stretched by the others' prefill."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_models import prompt, save_tiny_llama

from drivers.base import GenerationRequest
from drivers.native import NativeDriver, NativeDriverConfig
from engine_native.client import AsyncEngineClient
from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_native.messages import AddRequest, RequestOutput
from engine_native.model.bundled import bundled_model_path
from engine_native.model.tokenizer_loader import load_tokenizer
from engine_native.sampling_params import SamplingParams
from engine_native.step_trace import read_trace

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-burst")
    save_tiny_llama(path)
    return path


def _config(model: Path, trace: Path, hold_s: float) -> EngineConfig:
    return EngineConfig(
        model_path=str(model), dtype="float32", num_threads=1, step_trace_path=str(trace),
        cache=replace(CacheConfig(), num_blocks=64, block_size=16),
        scheduler=replace(SchedulerConfig(), burst_hold_s=hold_s),
    )


async def _serve(config: EngineConfig, arrivals: list[tuple[float, bool]]) -> list[float]:
    """Sends a request (`more_coming` as given) at each offset in seconds, reads every stream to its end and
    returns each request's first-token time after its own arrival."""
    client = AsyncEngineClient(config, progress=False)
    await client.start(timeout_s=120)
    try:
        start = time.monotonic()

        async def one(i: int, at: float, more: bool) -> float:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            sent = time.monotonic()
            stream = client.add(AddRequest(request_id=f"r{i}", prompt_token_ids=prompt(24, i),
                                           sampling_params=GREEDY, arrival_time=time.time(), more_coming=more))
            first = None
            while True:
                out = await asyncio.wait_for(stream.get(), 60)
                assert isinstance(out, RequestOutput), out
                if first is None:
                    first = time.monotonic() - sent
                if out.finish_reason is not None:
                    return first

        return list(await asyncio.gather(*(one(i, at, more) for i, (at, more) in enumerate(arrivals))))
    finally:
        await client.shutdown()


def _first_prefill(trace: Path) -> int:
    return next(s.admitted for s in read_trace(trace) if s.admitted)


def test_a_burst_on_its_way_is_prefilled_in_one_step(tiny: Path, tmp_path: Path) -> None:
    trace = tmp_path / "held.jsonl"
    # the first request says more are coming; the second comes 0.3 s later and says none are
    firsts = asyncio.run(_serve(_config(tiny, trace, hold_s=5.0), [(0.0, True), (0.3, False)]))
    assert _first_prefill(trace) == 2
    assert firsts[0] >= 0.25  # it waited for the second, not for the 5 s the hold allows
    assert firsts[0] < 4.0


def test_the_hold_ends_when_its_time_is_up(tiny: Path, tmp_path: Path) -> None:
    trace = tmp_path / "alone.jsonl"
    firsts = asyncio.run(_serve(_config(tiny, trace, hold_s=0.3), [(0.0, True)]))  # the rest never comes
    assert _first_prefill(trace) == 1
    assert firsts[0] >= 0.25


@pytest.mark.parametrize(("hold_s", "more_coming"), [(0.0, True), (5.0, False)])
def test_no_hold_when_off_or_when_nothing_more_is_coming(tiny: Path, tmp_path: Path, hold_s: float,
                                                          more_coming: bool) -> None:
    trace = tmp_path / "unheld.jsonl"
    firsts = asyncio.run(_serve(_config(tiny, trace, hold_s=hold_s), [(0.0, more_coming), (1.0, False)]))
    assert _first_prefill(trace) == 1
    assert firsts[0] < 1.0  # it did not wait for the second


def test_the_driver_says_more_are_coming_while_it_tokenizes_others() -> None:
    """The native driver counts the prompts it is tokenizing: what it sends meanwhile has `more_coming`."""
    driver = NativeDriver(NativeDriverConfig(progress=False))
    driver.tokenizer = load_tokenizer(bundled_model_path())
    driver.ready = True
    long = GenerationRequest(request_id="long", model=driver.served_model_name, prompt="hello world " * 60_000)

    async def run() -> tuple[int, int, int]:
        task = asyncio.create_task(driver.tokenize(long))
        await asyncio.sleep(0)  # the task runs up to its wait for the worker thread
        during = driver.tokenizing
        ids = await task
        return during, driver.tokenizing, len(ids)

    during, after, n = asyncio.run(run())
    assert (during, after) == (1, 0) and n > 100_000
