"""Admission control in front of the real engine (the native driver, the bundled SmolLM2) on prompts
that share a long prefix, the way the gateway calls it: `admit` with the driver's health, `started` at
the first chunk, `finished` at the end.

Before: the engine measured its prefill rate in prompt tokens *computed*, while the queue ahead of a
request was counted in whole prompts. With a 1,000-token prefix found in the prefix cache, ~64 of each
1,064 tokens are computed, so every predicted time to first token was ~15x what followed, beyond the
calibration's bounds, and `vllm bench serve --random-prefix-len 1000 --max-concurrency 8` had 49 of 64
requests refused (issue 10). The assertions are on ratios and refusals, not on speed: a slower machine
slows the measured rate and the real TTFTs alike.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, replace

from drivers.base import DriverError, GenerationRequest
from drivers.native import NativeDriver, NativeDriverConfig
from gateway.load_shedding import LoadShedder, SheddingPolicy

PREFIX, OWN, OUTPUT = 1000, 64, 8
CONCURRENCY, PER_WORKER = 8, 3
STANDARD = 1  # the tier of a request that names no priority on a server without auth


@dataclass
class Outcome:
    predicted_s: float | None  # uncalibrated, as admitted
    actual_s: float  # admission to first chunk


async def _closed_loop(driver: NativeDriver, shedder: LoadShedder, model: str) -> tuple[list[Outcome], int]:
    rng = random.Random(10)
    vocab = 40_000  # within SmolLM2's 49,152
    prefix = [rng.randrange(vocab) for _ in range(PREFIX)]
    refused = 0
    outcomes: list[Outcome] = []

    async def one(name: str, record: bool) -> None:
        nonlocal refused
        prompt = prefix + [rng.randrange(vocab) for _ in range(OWN)]
        request = GenerationRequest(request_id=name, model=model, tokenized_prompt=prompt, max_tokens=OUTPUT,
                                    temperature=0.0, ignore_eos=True, priority=STANDARD)
        try:
            pending = shedder.admit(await driver.health(), STANDARD, len(prompt), OUTPUT)
        except DriverError:
            refused += 1
            return
        admitted = time.monotonic()
        try:
            async for _ in driver.generate(request):
                if not pending.started:
                    shedder.started(pending)
                    if record:
                        outcomes.append(Outcome(pending.predicted_s, time.monotonic() - admitted))
        finally:
            shedder.finished(pending)

    await one("warm", record=False)  # the prefix is cached from here on, as in a steady load
    # The warm request's steps, the engine's first (slow while it warms up) and on the uncached prefix, are
    # not what a steady load is served at: let them leave the engine's rate window (STATS_WINDOW_S, 5 s).
    await asyncio.sleep(5.5)

    async def worker(w: int) -> None:
        # The first round's rate was measured on the cold prefix (computed whole): not recorded.
        for i in range(PER_WORKER):
            await one(f"w{w}-{i}", record=i > 0)

    await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
    return outcomes, refused


def test_a_shared_prefix_at_steady_concurrency_is_predicted_in_the_units_it_is_served() -> None:
    engine = NativeDriverConfig().engine
    driver = NativeDriver(NativeDriverConfig(
        engine=replace(engine, max_model_len=2048, num_threads=2,
                       cache=replace(engine.cache, num_blocks=1024, block_size=16),
                       # 3 new prompts a step: a queue forms at each round, and steps that leave it
                       # waiting measure the prefill rate.
                       scheduler=replace(engine.scheduler, max_num_batched_tokens=256)),
        progress=False,
    ))
    shedder = LoadShedder(SheddingPolicy())  # the default targets: standard waits at most 10 s

    async def main() -> tuple[list[Outcome], int]:
        await driver.start()
        try:
            return await _closed_loop(driver, shedder, driver.served_model_name)
        finally:
            await driver.stop()

    outcomes, refused = asyncio.run(main())
    assert refused == 0  # before: up to 21 of 24, as predictions passed the 10 s target
    predicted = [o for o in outcomes if o.predicted_s]
    # Requests admitted in the same step as others leave the rest waiting: such steps measure the rate.
    assert len(predicted) >= CONCURRENCY, outcomes
    ratio = sum(o.actual_s for o in predicted) / sum(o.predicted_s or 0 for o in predicted)
    each = statistics.median(o.actual_s / (o.predicted_s or 1) for o in predicted)
    # Units: computed tokens made the prediction ~15-20x the real wait (seen: actual / predicted 0.05).
    # Served tokens put it within a small factor (seen: 0.84 in all, 0.97 per request at the median).
    assert 1 / 3 <= ratio <= 4, (ratio, each, [(o.predicted_s, round(o.actual_s, 3)) for o in outcomes])
