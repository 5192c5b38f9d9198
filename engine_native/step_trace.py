"""A JSON line per engine step, and what such a trace says about decoding streams' inter-token time.

A decoding stream gets one token per step, so each of its inter-token gaps is (nearly) the interval of
the step that produced the token: the distribution of gaps a client measures (ITL) is the distribution
of step intervals, each step counted once per stream that decoded in it. A trace of the steps therefore
tells which steps make the tail, and what they held: prompt tokens computed beside the decodes, how
many prompts were admitted, how many of its decodes were a stream's first gap (a burst of requests that
reached the engine across two steps: the early ones decode while the later ones prefill), how long the
forward took and how long the loop around it.

`sluice serve --step-trace DIR` has every engine write `DIR/<node id>.jsonl`; `sluice bench steps FILE`
prints the summary below, and with a client's per-token arrival times (`delivery`) how long tokens took
to reach it after their step. Tracing costs a small write per step (a few microseconds); it is off by default.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import msgspec


class StepRecord(msgspec.Struct, frozen=True):
    end: float  # time.time() when the step ended
    interval_s: float  # since the previous step ended (after idle: since this step started)
    forward_s: float  # the model's forward and sampling alone
    decodes: int  # requests that computed one token after their last sampled one
    prefill_tokens: int  # prompt tokens computed (chunks of prompts, recomputes after preemption)
    prefill_seqs: int  # requests that computed prompt tokens
    admitted: int  # requests that joined the running set in this step
    cached_tokens: int  # prompt tokens the admitted requests found in the prefix cache
    sampled: int  # tokens sampled (decodes plus prompts that reached their end)
    running: int  # requests running after the step
    waiting: int  # requests waiting after the step
    preempted: int  # requests preempted to make room in this step
    # Of the decodes, those of requests whose first token came from the step before: this interval is their
    # first inter-token gap. Many of them in a step that also computes prompts is a burst split across two
    # steps (the burst's early arrivals decoding while its later ones prefill). 0 in traces written before it.
    first_gaps: int = 0

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decodes:
            return "prefill+decode"
        return "prefill" if self.prefill_tokens else "decode"


_encoder = msgspec.json.Encoder()
log = logging.getLogger(__name__)


class StepTraceWriter:
    """Appends records to a file, one JSON object a line, flushed per step so that a trace read
    while the server runs (or after it was killed) is whole up to its last step. A file that cannot
    be opened fails the engine's start; one that fails later (a full disk) stops the trace, not the
    engine: it is a diagnostic."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self._file: IO[bytes] | None = open(path, "ab")  # noqa: SIM115 - held for the engine's life, closed in close()

    def write(self, record: StepRecord) -> None:
        if self._file is None:
            return
        try:
            self._file.write(_encoder.encode(record) + b"\n")
            self._file.flush()
        except OSError as exc:
            log.warning("step trace %s stopped: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def read_trace(path: str | Path) -> list[StepRecord]:
    decoder = msgspec.json.Decoder(StepRecord)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]


def trace_file_name(node_id: str) -> str:
    """A node id as a file name: version-scoped ids (`v2/node-0`) hold a slash."""
    return node_id.replace("/", "_") + ".jsonl"


@dataclass(frozen=True)
class KindSummary:
    kind: str
    steps: int
    decode_gaps: int  # inter-token gaps these steps made (their decodes)
    interval_p50_s: float
    interval_max_s: float
    mean_decodes: float
    mean_prefill_tokens: float
    mean_admitted: float
    loop_share: float  # of the steps' intervals, the part outside the forward (scheduling, outputs, IPC)


@dataclass(frozen=True)
class TraceSummary:
    steps: int
    seconds: float
    decode_gaps: int
    gap_p50_s: float  # the step intervals as decoding streams saw them: one count per decode
    gap_p99_s: float
    kinds: list[KindSummary]
    tail_kinds: dict[str, int]  # of the gaps at or above the p99, how many each kind of step made
    tail_mean_prefill_tokens: float  # prompt tokens computed in the steps that made those gaps
    tail_mean_admitted: float
    tail_first_gaps: int  # of the gaps at or above the p99, how many were a stream's first inter-token gap


def weighted_quantile(values: Sequence[float], weights: Sequence[int], q: float) -> float:
    """The value below which a fraction `q` of the total weight lies (values with weight 0 ignored)."""
    pairs = sorted((v, w) for v, w in zip(values, weights, strict=True) if w > 0)
    if not pairs:
        return 0.0
    total = sum(w for _, w in pairs)
    rank = max(1, math.ceil(q * total))
    seen = 0
    for value, weight in pairs:
        seen += weight
        if seen >= rank:
            return value
    return pairs[-1][0]


def summarize(records: Iterable[StepRecord]) -> TraceSummary:
    steps = list(records)
    intervals = [r.interval_s for r in steps]
    decodes = [r.decodes for r in steps]
    p99 = weighted_quantile(intervals, decodes, 0.99)
    kinds = []
    for kind in ("decode", "prefill+decode", "prefill"):
        mine = [r for r in steps if r.kind == kind]
        if not mine:
            continue
        total_s = sum(r.interval_s for r in mine)
        kinds.append(KindSummary(
            kind=kind,
            steps=len(mine),
            decode_gaps=sum(r.decodes for r in mine),
            interval_p50_s=weighted_quantile([r.interval_s for r in mine], [1] * len(mine), 0.5),
            interval_max_s=max(r.interval_s for r in mine),
            mean_decodes=sum(r.decodes for r in mine) / len(mine),
            mean_prefill_tokens=sum(r.prefill_tokens for r in mine) / len(mine),
            mean_admitted=sum(r.admitted for r in mine) / len(mine),
            loop_share=(total_s - sum(r.forward_s for r in mine)) / total_s if total_s > 0 else 0.0,
        ))
    tail = [r for r in steps if r.decodes and r.interval_s >= p99]
    tail_gaps = sum(r.decodes for r in tail)
    tail_kinds: dict[str, int] = {}
    for r in tail:
        tail_kinds[r.kind] = tail_kinds.get(r.kind, 0) + r.decodes
    return TraceSummary(
        steps=len(steps),
        seconds=sum(intervals),
        decode_gaps=sum(decodes),
        gap_p50_s=weighted_quantile(intervals, decodes, 0.5),
        gap_p99_s=p99,
        kinds=kinds,
        tail_kinds=tail_kinds,
        tail_mean_prefill_tokens=sum(r.prefill_tokens * r.decodes for r in tail) / tail_gaps if tail_gaps else 0.0,
        tail_mean_admitted=sum(r.admitted * r.decodes for r in tail) / tail_gaps if tail_gaps else 0.0,
        tail_first_gaps=sum(r.first_gaps for r in tail),
    )


@dataclass(frozen=True)
class DeliverySummary:
    """How long a client's tokens took to reach it after the step that sampled them (seconds)."""

    tokens: int  # client tokens matched to a step
    before_first_step: int  # arrivals earlier than every step's end: another run's, or the clocks disagree
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float


def delivery(records: Iterable[StepRecord], arrivals: Iterable[float]) -> DeliverySummary:
    """Each token's arrival at the client (wall clock) minus the end of the last step that sampled
    tokens before it: the gateway's, the network's and the client's share of an inter-token gap, which
    the trace's own gaps leave out. One token a step per stream: its step is the last one before it."""
    ends = sorted(r.end for r in records if r.sampled > 0)
    delays: list[float] = []
    early = 0
    for t in arrivals:
        i = bisect.bisect_right(ends, t) - 1
        if i < 0:
            early += 1
        else:
            delays.append(t - ends[i])
    ones = [1] * len(delays)
    return DeliverySummary(
        tokens=len(delays),
        before_first_step=early,
        p50_s=weighted_quantile(delays, ones, 0.5),
        p90_s=weighted_quantile(delays, ones, 0.9),
        p99_s=weighted_quantile(delays, ones, 0.99),
        max_s=max(delays, default=0.0),
    )


def format_summary(s: TraceSummary) -> str:
    lines = [
        (f"{s.steps} steps over {s.seconds:.1f} s; {s.decode_gaps} inter-token gaps "
         f"(p50 {s.gap_p50_s * 1000:.0f} ms, p99 {s.gap_p99_s * 1000:.0f} ms: step intervals, once per decoding stream)"),
        (f"{'kind':<15} {'steps':>6} {'gaps':>7} {'p50 ms':>7} {'max ms':>7} {'decodes':>8} {'prompt tok':>10} "
         f"{'admitted':>8} {'loop':>5}"),
    ]
    for k in s.kinds:
        lines.append(
            f"{k.kind:<15} {k.steps:>6} {k.decode_gaps:>7} {k.interval_p50_s * 1000:>7.0f} {k.interval_max_s * 1000:>7.0f} "
            f"{k.mean_decodes:>8.1f} {k.mean_prefill_tokens:>10.0f} {k.mean_admitted:>8.1f} {k.loop_share:>5.0%}"
        )
    tail = ", ".join(f"{kind} {n}" for kind, n in sorted(s.tail_kinds.items()))
    lines.append(
        f"gaps at or above the p99 come from: {tail or 'none'}; those steps computed "
        f"{s.tail_mean_prefill_tokens:.0f} prompt tokens and admitted {s.tail_mean_admitted:.1f} requests on average; "
        f"{s.tail_first_gaps} of those gaps were a stream's first (its burst split across two steps)"
    )
    return "\n".join(lines)
