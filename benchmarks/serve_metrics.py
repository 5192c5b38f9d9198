"""What `sluice bench serve` computes from the requests it sent, with the definitions of vLLM's
`vllm bench serve` (`vllm/benchmarks/serve.py`), so the two report the same figures for the same run:

    chunk   an SSE event that carries `choices` (its text may be empty: a role-only or finish-only event
            counts too); usage-only events and [DONE] are not chunks
    TTFT    first chunk - request sent
    ITL     every gap between two consecutive chunks of a request (all gaps of all requests pooled)
    E2EL    last chunk - request sent, so TTFT + sum(ITL) == E2EL for every request
    TPOT    (E2EL - TTFT) / (output_tokens - 1), per request with output_tokens > 1
    output_tokens   `usage.completion_tokens` the server reports, else the tokenizer's count of the text
    prompt_tokens   `usage.prompt_tokens`, else the client's count of the prompt
    throughputs     completed requests and their tokens / wall time of the whole run

A request fails on a non-200 status, a transport error, an error event in its stream (vLLM's client
counts that as a success if a chunk came first; we do not), or a stream without a chunk.
Percentiles interpolate linearly between ranks (numpy's default); "median" is p50.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    ok: bool = False
    status: int | None = None  # HTTP status; None: no response came
    failure: str = ""  # why it failed, for `failed_by_status`: "503", "stream error", "transport error", ...
    error: str = ""  # the detail
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        """0 for a single output token, as vLLM's goodput counts it."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def detail(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": self.ttft_s * 1000,
            "tpot_ms": self.tpot_s * 1000,
            "e2el_ms": self.e2e_s * 1000,
            "itl_ms": [x * 1000 for x in self.itl_s],
        }


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float  # the median
    p90: float
    p99: float
    std: float = 0.0

    @staticmethod
    def of(values_s: list[float]) -> Stats:
        """Stats in milliseconds."""
        ms = sorted(v * 1000.0 for v in values_s)
        if not ms:
            return Stats(0.0, 0.0, 0.0, 0.0, 0.0)
        mean, std = statistics.fmean(ms), statistics.pstdev(ms)
        return Stats(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), std)


@dataclass(frozen=True)
class BenchResult:
    model: str
    endpoint: str
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    goodput: float | None  # req/s meeting every SLO given; None without SLOs
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    errors: list[str]
    failed_by_status: dict[str, int] = field(default_factory=dict)  # "503": 4, "transport error": 1, ...
    dataset: str = ""
    requests: list[dict[str, Any]] | None = None  # per request, with --save-detailed

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class Slos:
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def percentile(sorted_values: list[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(
    records: list[RequestRecord],
    duration: float,
    *,
    model: str,
    endpoint: str,
    dataset: str,
    slos: Slos,
    detailed: bool,
) -> BenchResult:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    goodput = None
    if slos.ttft_ms is not None or slos.tpot_ms is not None:
        good = [
            r
            for r in ok
            if (slos.ttft_ms is None or r.ttft_s * 1000 <= slos.ttft_ms)
            and (slos.tpot_ms is None or r.tpot_s * 1000 <= slos.tpot_ms)
        ]
        goodput = len(good) / duration if duration > 0 else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return BenchResult(
        model=model,
        endpoint=endpoint,
        duration_s=duration,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(in_tokens + out_tokens),
        goodput=goodput,
        ttft_ms=Stats.of([r.ttft_s for r in ok]),
        tpot_ms=Stats.of([r.tpot_s for r in ok if r.output_tokens > 1]),
        itl_ms=Stats.of([x for r in ok for x in r.itl_s]),
        e2e_ms=Stats.of([r.e2e_s for r in ok]),
        errors=sorted({r.error for r in records if not r.ok})[:10],
        failed_by_status=dict(sorted(Counter(r.failure for r in records if not r.ok).items())),
        dataset=dataset,
        requests=[r.detail() for r in records] if detailed else None,
    )


def format_report(result: BenchResult) -> str:
    lines = [
        f"{' Serving Benchmark Result ':=^60}",
        f"{'Model:':<40}{result.model}",
        f"{'Endpoint / prompts:':<40}{result.endpoint} / {result.dataset}",
        f"{'Successful requests:':<40}{result.completed}",
        f"{'Failed requests:':<40}{result.failed}",
    ]
    for failure, count in result.failed_by_status.items():
        lines.append(f"{'  failed, ' + failure + ':':<40}{count}")
    lines += [
        f"{'Benchmark duration (s):':<40}{result.duration_s:.2f}",
        f"{'Total input tokens:':<40}{result.total_input_tokens}",
        f"{'Total generated tokens:':<40}{result.total_output_tokens}",
        f"{'Request throughput (req/s):':<40}{result.request_throughput:.2f}",
        f"{'Output token throughput (tok/s):':<40}{result.output_throughput:.2f}",
        f"{'Total token throughput (tok/s):':<40}{result.total_token_throughput:.2f}",
    ]
    if result.goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{result.goodput:.2f}")
    for name, stats in (
        ("TTFT", result.ttft_ms),
        ("TPOT", result.tpot_ms),
        ("ITL", result.itl_ms),
        ("E2EL", result.e2e_ms),
    ):
        lines.append(f"{' ' + name + ' (ms) ':-^60}")
        for label, value in (("Mean", stats.mean), ("Median", stats.p50), ("P90", stats.p90),
                             ("P99", stats.p99)):
            lines.append(f"{label + ' ' + name + ' (ms):':<40}{value:.2f}")
    for error in result.errors:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
