"""`sluice bench <name>`: the one entry to every benchmark (`sluice bench ...` is `python -m benchmarks ...`).

Each module below adds its own subcommand and options with `add_arguments(sub)` and leaves its handler
in `func`. `engine` is the exception: it loads torch on import, so its options are parsed by the module
itself, only when it runs (`sluice bench engine --help`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks import (
    decode_attention,
    fleet,
    fleet_affinity,
    fleet_failover,
    gateway_overhead,
    parallel,
    prefix_cache,
    priority,
    ratelimit_admission,
    serve,
    spike,
    step_profile,
    step_trace,
    sweep,
    telemetry_overhead,
    tenancy_overhead,
    tokenize_stall,
    version_switch,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice bench", description="Sluice's benchmarks")
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    serve.add_arguments(sub)
    engine = sub.add_parser("engine", add_help=False, help="our engine vs Hugging Face generate (see --help)")
    engine.set_defaults(func=_engine, engine_args=[])
    gateway_overhead.add_arguments(sub)
    fleet.add_arguments(sub)
    parallel.add_arguments(sub)
    fleet_failover.add_arguments(sub)
    fleet_affinity.add_arguments(sub)
    priority.add_arguments(sub)
    prefix_cache.add_arguments(sub)
    spike.add_arguments(sub)
    step_profile.add_arguments(sub)
    decode_attention.add_arguments(sub)
    step_trace.add_arguments(sub)
    sweep.add_arguments(sub)
    ratelimit_admission.add_arguments(sub)
    tenancy_overhead.add_arguments(sub)
    telemetry_overhead.add_arguments(sub)
    tokenize_stall.add_arguments(sub)
    version_switch.add_arguments(sub)
    return parser


def _engine(args: argparse.Namespace) -> int:
    from benchmarks.engine import main as engine_main  # lazy: torch loads only for this benchmark

    return engine_main(args.engine_args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.func is _engine:
        args.engine_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    result: int = args.func(args)
    return result
