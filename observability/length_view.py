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

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from observability.node_health import PROMPT_BUCKETS, prompt_bucket

if TYPE_CHECKING:
    from observability.timeline import RequestTimeline

PROMPT_LABELS = tuple([f"<={e // 1024}k" if e >= 1024 else f"<={e}" for e in PROMPT_BUCKETS] + [">8k"])
POSITION_EDGES = (16, 64, 256, 1024)
POSITION_LABELS = ("2-16", "17-64", "65-256", "257-1k", ">1k")
SERIES = ("ttft_by_prompt", "itl_by_prompt", "itl_by_position")


def position_bucket(position: int) -> str:
    """Label of an output token's position (1-based; the first token has no inter-token gap)."""
    for edge, label in zip(POSITION_EDGES, POSITION_LABELS, strict=False):
        if position <= edge:
            return label
    return POSITION_LABELS[-1]


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
    __slots__ = ("count", "samples")

    def __init__(self) -> None:
        self.count = 0
        self.samples: list[float] = []

    def add(self, value: float, cap: int, rng: random.Random) -> None:
        self.count += 1
        if len(self.samples) < cap:
            self.samples.append(value)
        else:  # keep each of the `count` values with probability cap / count
            slot = rng.randrange(self.count)
            if slot < cap:
                self.samples[slot] = value

    def quantiles(self) -> Quantiles:
        ordered = sorted(self.samples)

        def at(q: float) -> float:  # nearest rank
            return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))] * 1000, 3)

        return Quantiles(at(0.5), at(0.9), self.count)


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
                series["ttft_by_prompt"].setdefault(bucket, _Reservoir()).add(c.first_token - t.started, cap, rng)
            by_prompt = series["itl_by_prompt"].setdefault(bucket, _Reservoir()) if c.itl else None
            for i, gap in enumerate(c.itl):
                assert by_prompt is not None
                by_prompt.add(gap, cap, rng)
                series["itl_by_position"].setdefault(position_bucket(i + 2), _Reservoir()).add(gap, cap, rng)

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
