"""`sluice bench sweep`: the throughput/latency knob, measured. One `sluice serve` per setting, the same
load against each (`benchmarks.serve.run_benchmark`), then output throughput against TTFT p99 drawn
into a PNG, plus the figures as JSON.

    sluice bench sweep --setting "--max-num-seqs 4" --setting "--max-num-seqs 16" \
        --setting "--max-num-seqs 64 --long-prefill-token-threshold 64" --out sweep.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
from dataclasses import asdict
from typing import Any

from benchmarks.serve import BenchConfig, run_benchmark
from benchmarks.server_process import ServerProcess

DEFAULT_SETTINGS = [
    "--max-num-seqs 4",
    "--max-num-seqs 16",
    "--max-num-seqs 64",
    "--max-num-seqs 64 --max-num-batched-tokens 128 --long-prefill-token-threshold 64",
]


def run_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    points = []
    for setting in args.setting or DEFAULT_SETTINGS:
        options = [
            "--driver",
            "native",
            "--num-threads",
            str(args.num_threads),
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            args.kv_cache_memory,
            "--no-load-shedding",
            *shlex.split(setting),
        ]
        with ServerProcess(options) as server:
            config = BenchConfig(
                base_url=server.base_url,
                num_prompts=args.num_prompts,
                input_len=args.input_len,
                output_len=args.output_len,
                ignore_eos=True,
                temperature=0.0,
                request_rate=args.request_rate,
                progress=False,
            )
            result = asyncio.run(run_benchmark(config))
        point = {
            "setting": setting,
            "output_tokens_per_s": result.output_throughput,
            "requests_per_s": result.request_throughput,
            "ttft_p99_ms": result.ttft_ms.p99,
            "tpot_p50_ms": result.tpot_ms.p50,
            "failed": result.failed,
            "load_average": os.getloadavg(),
            "result": asdict(result),
        }
        print(
            f"{setting:<70} {point['output_tokens_per_s']:8.1f} tok/s   TTFT p99 {point['ttft_p99_ms']:8.1f} ms"
            f"   TPOT p50 {point['tpot_p50_ms']:6.1f} ms   failed {result.failed}",
            flush=True,
        )
        points.append(point)
    return points


def plot(points: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
    except ImportError as exc:  # an extra, not a dependency of the service
        raise SystemExit("sluice bench sweep draws with matplotlib: pip install -e '.[bench]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p["ttft_p99_ms"] for p in points]
    ys = [p["output_tokens_per_s"] for p in points]
    ax.plot(xs, ys, "o")
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(
            p["setting"].replace("--", ""), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7
        )
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Sluice native engine: throughput vs TTFT p99 per setting")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _main(args: argparse.Namespace) -> int:
    points = run_sweep(args)
    plot(points, args.out)
    json_path = args.json_out or os.path.splitext(args.out)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump(points, f, indent=2)
    print(f"plot: {args.out}  figures: {json_path}  load average: {os.getloadavg()}")
    return 0 if all(p["failed"] == 0 for p in points) else 1


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep",
        help="several server settings: throughput vs TTFT p99 into a PNG",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--setting",
        action="append",
        default=None,
        help=f"`sluice serve` options of one point, repeatable; default: {DEFAULT_SETTINGS}",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests per setting")
    p.add_argument("--input-len", type=int, default=64, help="approximate prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = all at once"
    )
    p.add_argument("--num-threads", type=int, default=2, help="engine torch threads")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of each server")
    p.add_argument("--out", default="sweep.png", help="PNG path")
    p.add_argument("--json-out", default=None, help="JSON path; default: beside the PNG")
    p.set_defaults(func=_main)
