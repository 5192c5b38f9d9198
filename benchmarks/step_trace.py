"""`sluice bench steps FILE...`: where a served run's inter-token time went, from engine step traces.

Run the server with `--step-trace DIR`, put a load on it (`sluice bench serve`, or any client), then
summarize `DIR/<node id>.jsonl`: the steps by kind (decodes only, prompt chunks beside decodes, prompt
chunks alone), how long each kind took and what it held, and which steps made the inter-token gaps at
and above the p99. A decoding stream gets one token a step, so its gaps are the intervals of the steps
it decoded in: the p99 here is the server's side of the ITL p99 a client measures (which adds the
gateway, the network and the client's own scheduling).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from engine_native.step_trace import format_summary, read_trace, summarize


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("steps", help="summarize engine step traces (sluice serve --step-trace DIR)")
    p.add_argument("traces", nargs="+", type=Path, help="DIR/<node id>.jsonl files")
    p.add_argument("--since", type=float, default=None,
                   help="only steps that ended at or after this Unix time (e.g. a benchmark's start)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the summaries as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summaries = {}
    for path in args.traces:
        records = [r for r in read_trace(path) if args.since is None or r.end >= args.since]
        summary = summarize(records)
        summaries[str(path)] = asdict(summary)
        print(f"== {path}")
        print(format_summary(summary))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summaries, indent=2))
    return 0
