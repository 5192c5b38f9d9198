"""Where the latency goes by token length, over time: the data of the console's "Latency" tab
(`GET /admin/latency/by-length`).

Per minute of the last `window_minutes`, from every finished request's timeline:

    ttft_by_prompt      time to first token, by prompt-length bucket (<=128, <=512, <=2k, <=8k, >8k)
    itl_by_prompt       inter-token latency, by the same buckets
    itl_by_position     inter-token latency by output position (tokens 2-16, 17-64, 65-256, 257-1k, >1k)

each as p50 / p90 and a count, so a regression for long prompts (or late in long outputs) shows as
one line leaving the others. Samples are kept per (minute, series, bucket) in a bounded reservoir
(`max_samples`), so memory stays flat whatever the traffic; the percentiles are those of the sample.
The same figures, without the time axis, are the Prometheus histograms labelled `prompt_bucket`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from observability.node_health import PROMPT_BUCKETS, prompt_bucket

if TYPE_CHECKING:
    from observability.timeline import RequestTimeline

PROMPT_LABELS = tuple([f"<={e // 1024}k" if e >= 1024 else f"<={e}" for e in PROMPT_BUCKETS] + [">8k"])
POSITION_EDGES = (16, 64, 256, 1024)  # the last output position (1-based) of each bucket but the last
POSITION_LABELS = ("2-16", "17-64", "65-256", "257-1k", ">1k")
SERIES = ("ttft_by_prompt", "itl_by_prompt", "itl_by_position")


class Quantiles(msgspec.Struct, frozen=True):
    p50_ms: float
    p90_ms: float
    count: int  # observations in the minute (the percentiles come from up to max_samples of them)


class LengthSeries(msgspec.Struct, frozen=True):
    """One bucket's line: a point per minute of `LengthLatencyReport.minutes`, null where none."""

    bucket: str
    points: list[Quantiles | None]


class LengthLatencyReport(msgspec.Struct, frozen=True):
    minutes: list[float]  # time.time() of each minute's start, oldest first
    ttft_by_prompt: list[LengthSeries]
    itl_by_prompt: list[LengthSeries]
    itl_by_position: list[LengthSeries]


class _Reservoir:
    """Up to `cap` of the values added, each value equally likely to be among them (Li's Algorithm L).

    Once full, the draws say how many values to pass over before the next one replaces a random
    sample, so a value costs a comparison, not a draw: a request's gaps are added when it ends, one
    per token, and the plain reservoir's draw a value made that ~1.3 µs a token (of the gateway's
    ~75 µs of CPU a streamed token), now ~0.05. Li, "Reservoir-sampling algorithms of time
    complexity O(n(1 + log(N/n)))", 1994.
    """

    __slots__ = ("_next", "_w", "count", "samples")

    def __init__(self) -> None:
        self.count = 0
        self.samples: list[float] = []
        self._w = 1.0
        self._next = 0  # 0-based index, among all values added, of the next one to take once full

    def add(self, values: Sequence[float], cap: int, rng: random.Random) -> None:
        samples, n = self.samples, len(values)
        if cap <= 0:
            self.count += n
            return
        i = 0
        while len(samples) < cap and i < n:
            samples.append(values[i])
            i += 1
            if len(samples) == cap:  # just filled: the first skip starts from here (_w is still 1.0)
                self._next = self.count + i - 1
                self._advance(cap, rng)
        end = self.count + n
        while len(samples) == cap and self._next < end:
            samples[int(rng.random() * cap)] = values[self._next - self.count]
            self._advance(cap, rng)
        self.count = end

    def _advance(self, cap: int, rng: random.Random) -> None:
        """W <- W * U^(1/cap); pass over floor(log U' / log(1 - W)) values; the next one is taken."""
        self._w *= math.exp(math.log(1.0 - rng.random()) / cap)  # 1 - random() is in (0, 1]
        skip = math.floor(math.log(1.0 - rng.random()) / math.log1p(-self._w)) if self._w < 1.0 else 0
        self._next += skip + 1

    def quantiles(self) -> Quantiles:
        ordered = sorted(self.samples)

        def at(q: float) -> float:  # nearest rank
            return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))] * 1000, 3)

        return Quantiles(at(0.5), at(0.9), self.count)


def _reservoir(buckets: dict[str, _Reservoir], label: str) -> _Reservoir:
    found = buckets.get(label)
    if found is None:
        found = buckets[label] = _Reservoir()
    return found


class LengthLatencyView:
    def __init__(self, window_minutes: int = 60, max_samples: int = 512,
                 clock: Callable[[], float] = time.time) -> None:
        self.window_minutes = window_minutes
        self.max_samples = max_samples
        self.clock = clock
        self._rng = random.Random(0)
        # minute (int(t // 60)) -> series -> bucket -> reservoir
        self._minutes: dict[int, dict[str, dict[str, _Reservoir]]] = {}

    def observe(self, t: RequestTimeline) -> None:
        minute = int(self.clock() // 60)
        series = self._minutes.get(minute)
        if series is None:
            series = self._minutes[minute] = {name: {} for name in SERIES}
            for old in [m for m in self._minutes if m <= minute - self.window_minutes]:
                del self._minutes[old]
        cap, rng = self.max_samples, self._rng
        for c in t.choices:
            bucket = prompt_bucket(c.prompt_tokens)
            if c.first_token is not None:
                _reservoir(series["ttft_by_prompt"], bucket).add((c.first_token - t.started,), cap, rng)
            if not c.itl:
                continue
            _reservoir(series["itl_by_prompt"], bucket).add(c.itl, cap, rng)
            # Gap i comes before output token i + 2: each position bucket takes one slice of the gaps.
            start, n = 0, len(c.itl)
            for edge, label in zip((*POSITION_EDGES, None), POSITION_LABELS, strict=True):
                end = n if edge is None else min(n, edge - 1)
                if start < end:
                    _reservoir(series["itl_by_position"], label).add(c.itl[start:end], cap, rng)
                start = end

    def report(self) -> LengthLatencyReport:
        now = int(self.clock() // 60)
        minutes = list(range(now - self.window_minutes + 1, now + 1))

        def lines(name: str, labels: tuple[str, ...]) -> list[LengthSeries]:
            out = []
            for label in labels:
                points = []
                for m in minutes:
                    r = self._minutes.get(m, {}).get(name, {}).get(label)
                    points.append(r.quantiles() if r is not None and r.samples else None)
                if any(p is not None for p in points):
                    out.append(LengthSeries(label, points))
            return out

        return LengthLatencyReport(
            minutes=[m * 60.0 for m in minutes],
            ttft_by_prompt=lines("ttft_by_prompt", PROMPT_LABELS),
            itl_by_prompt=lines("itl_by_prompt", PROMPT_LABELS),
            itl_by_position=lines("itl_by_position", POSITION_LABELS),
        )
