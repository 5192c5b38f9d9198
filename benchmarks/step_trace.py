"""`sluice bench steps FILE...`: where a served run's inter-token time went, from engine step traces.

Run the server with `--step-trace DIR`, put a load on it (`sluice bench serve`, or any client), then
summarize `DIR/<node id>.jsonl`: the steps by kind (decodes only, prompt chunks beside decodes, prompt
chunks alone), how long each kind took and what it held, and which steps made the inter-token gaps at
and above the p99. A decoding stream gets one token a step, so its gaps are the intervals of the steps
it decoded in: the p99 here is the server's side of the ITL p99 a client measures (which adds the
gateway, the network and the client's own scheduling). `--client FILE` measures that rest: a result of
`vllm bench serve --save-detailed` (each request's start, time to first token and gaps, on the client's
monotonic clock) is put on the wall clock, and each token's arrival is set against the end of the step
before it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine_native.step_trace import StepRecord, delivery, format_summary, read_trace, summarize


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("steps", help="summarize engine step traces (sluice serve --step-trace DIR)")
    p.add_argument("traces", nargs="+", type=Path, help="DIR/<node id>.jsonl files")
    p.add_argument("--since", type=float, default=None,
                   help="only steps that ended at or after this Unix time (e.g. a benchmark's start)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the summaries as JSON")
    p.add_argument("--client", type=Path, default=None,
                   help="a `vllm bench serve --save-detailed` result of a run against this server: how long its "
                        "tokens took to reach the client after their steps")
    p.add_argument("--client-clock-offset", type=float, default=None,
                   help="wall clock minus the client's monotonic clock, in seconds (default: this machine's, "
                        "right when the client ran here and the machine has not rebooted since)")
    p.set_defaults(func=run)


def client_arrivals(result: dict[str, Any], clock_offset: float) -> list[float]:
    """Every token's arrival at the client, on the wall clock, from a detailed vLLM benchmark result."""
    try:
        starts, ttfts, itls = result["start_times"], result["ttfts"], result["itls"]
    except KeyError as exc:
        raise ValueError(f"no {exc.args[0]!r} in the client result: run vllm bench serve with --save-detailed") from None
    arrivals: list[float] = []
    for start, ttft, gaps in zip(starts, ttfts, itls, strict=True):
        if not ttft:
            continue  # a request that failed before its first token
        t = start + ttft + clock_offset
        arrivals.append(t)
        for gap in gaps:
            t += gap
            arrivals.append(t)
    return arrivals


def run(args: argparse.Namespace) -> int:
    summaries: dict[str, object] = {}
    every: list[StepRecord] = []
    for path in args.traces:
        records = [r for r in read_trace(path) if args.since is None or r.end >= args.since]
        every += records
        summary = summarize(records)
        summaries[str(path)] = asdict(summary)
        print(f"== {path}")
        print(format_summary(summary))
    if args.client is not None:
        offset = time.time() - time.monotonic() if args.client_clock_offset is None else args.client_clock_offset
        try:
            arrivals = client_arrivals(json.loads(args.client.read_text()), offset)
        except (OSError, ValueError, TypeError) as exc:  # unreadable, not JSON, or not a detailed result
            print(f"sluice bench steps: {args.client}: {exc}")
            return 2
        d = delivery(every, arrivals)
        summaries[f"client {args.client}"] = asdict(d)
        print(f"== client {args.client}")
        print(f"{d.tokens} tokens; after the end of their step: p50 {d.p50_s * 1e3:.1f} ms, p90 {d.p90_s * 1e3:.1f}, "
              f"p99 {d.p99_s * 1e3:.1f}, max {d.max_s * 1e3:.1f}; {d.before_first_step} before every step "
              "(another run's, or the clocks disagree)")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summaries, indent=2))
    return 0
