"""`sluice simulate`: scaling policies through a day of traffic, and the queueing self-check.

    sluice simulate day  [--profile NAME] [--peak-rps R] [--out DIR] ...   policies compared, PNGs + JSON
    sluice simulate mmc  [--servers C] [--load RHO] [--requests N]          the simulator vs Erlang C
    sluice simulate profiles                                                the cost profiles available
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from scaling.desired import ScalingPolicy
from simulator.fleet import FleetConfig, Policy, simulate
from simulator.policies import Fixed, Forecast, Reactive, hourly_rates, worker_capacity_rps
from simulator.profile import CostProfile, available_profiles
from simulator.queueing import mmc_mean_wait
from simulator.report import plot, summarize, table
from simulator.traffic import Arrivals, DayShape, Workload, day


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("day", help="compare scaling policies through a day of traffic",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--profile", default="h100-llama70b-tp8", help=f"cost profile: {', '.join(available_profiles())} "
                   "or a JSON path")
    d.add_argument("--peak-rps", type=float, default=60.0, help="arrivals per second at the daily peak")
    d.add_argument("--bursts", type=int, default=4, help="bursts during working hours")
    d.add_argument("--burst-factor", type=float, default=2.0, help="rate multiplier during a burst")
    d.add_argument("--prompt-median", type=float, default=Workload.prompt_median, help="prompt tokens, median")
    d.add_argument("--output-median", type=float, default=Workload.output_median, help="output tokens, median")
    d.add_argument("--ttft-targets", default="2,10,30", help="TTFT target per tier, seconds")
    d.add_argument("--fixed", type=int, action="append", default=None,
                   help="fixed fleet sizes to compare (repeatable); default: sized for the peak")
    d.add_argument("--cold-start", type=float, default=None, help="override the profile's cold start, s")
    d.add_argument("--min-workers", type=int, default=1, help="floor of the reactive policies")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--out", type=Path, default=Path("sim-out"), help="folder for the PNGs and summary.json")
    d.set_defaults(func=_day)
    m = sub.add_parser("mmc", help="the simulator against the M/M/c closed form",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m.add_argument("--servers", type=int, default=2)
    m.add_argument("--load", type=float, default=0.5, help="utilization rho = lambda / (c mu)")
    m.add_argument("--requests", type=int, default=150_000)
    m.add_argument("--seed", type=int, default=1)
    m.set_defaults(func=_mmc)
    p = sub.add_parser("profiles", help="list the cost profiles")
    p.set_defaults(func=_profiles)
    return parser


def _day(args: argparse.Namespace) -> int:
    profile = CostProfile.load(args.profile)
    if args.cold_start is not None:
        profile = replace(profile, cold_start_s=args.cold_start)
    targets = tuple(float(v) for v in args.ttft_targets.split(","))
    workload = Workload(prompt_median=args.prompt_median, output_median=args.output_median)
    shape = DayShape(peak_rps=args.peak_rps, bursts=args.bursts, burst_factor=args.burst_factor)
    arrivals, bursts = day(shape, workload, args.seed)
    history, _ = day(shape, workload, args.seed + 1000)  # "yesterday": what the forecast learned from
    capacity = worker_capacity_rps(profile, workload)
    peak_size = math.ceil(args.peak_rps / (capacity * 0.8))
    scaling = ScalingPolicy(ttft_targets_s=targets, min_workers=args.min_workers, max_workers=256)
    config = FleetConfig(ttft_targets_s=targets, initial_workers=peak_size)
    policies: list[Policy] = [Fixed(n) for n in (args.fixed or [peak_size])]
    policies.append(Reactive(scaling))
    policies.append(Forecast(Reactive(scaling), hourly_rates(history), capacity,
                             lead_s=profile.cold_start_s + config.control_interval_s))
    print(f"profile {profile.name}: one worker serves ~{capacity:.1f} requests/s of this workload; "
          f"{len(arrivals):,} requests, peak {args.peak_rps:g}/s, bursts at "
          f"{', '.join(f'{b.start_s / 3600:.1f} h' for b in bursts)}", flush=True)
    results = []
    for policy in policies:
        started = time.monotonic()
        results.append(simulate(profile, config, policy, arrivals))
        print(f"  {policy.name}: simulated in {time.monotonic() - started:.0f} s", flush=True)
    summaries = [summarize(r, targets) for r in results]
    print(table(summaries, targets))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "profile": profile.to_json(), "peak_rps": args.peak_rps, "requests": len(arrivals), "seed": args.seed,
        "worker_capacity_rps": round(capacity, 3), "fixed_peak_size": peak_size,
        "bursts": [{"start_h": round(b.start_s / 3600, 2), "minutes": b.duration_s / 60, "factor": b.factor}
                   for b in bursts],
        "policies": [s.to_json() for s in summaries],
    }
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    for path in plot(results, targets, args.out):
        print(f"wrote {path}")
    return 0


def mmc_run(servers: int, load: float, requests: int, seed: int) -> tuple[float, float, np.ndarray, Arrivals]:
    """Simulate M/M/c through the fleet model: one sequence per worker, free prefill, output lengths
    geometric (the discrete exponential) of mean 1,000 steps of 1 ms: service ~ Exp(mean ~1 s).
    Returns (simulated mean wait, Erlang C mean wait, waits, arrivals)."""
    rng = np.random.default_rng(seed)
    mean_output, step = 1000, 0.001
    service_rate = 1.0 / ((mean_output - 1) * step)  # the first token comes from the (free) prefill
    arrival_rate = load * servers * service_rate
    t = np.cumsum(rng.exponential(1.0 / arrival_rate, requests))
    output = rng.geometric(1.0 / mean_output, requests)
    zeros = np.zeros(requests, dtype=np.int64)
    arrivals = Arrivals(t, zeros, zeros, output)
    profile = CostProfile("mmc", step_base_s=step, per_seq_s=0.0, per_context_token_s=0.0,
                          prefill_tokens_per_s=math.inf, max_num_seqs=1, kv_tokens=1 << 62, cold_start_s=0.0)
    config = FleetConfig(ttft_targets_s=(math.inf,), shedding=False, initial_workers=servers, hold_max=(1 << 62,))
    result = simulate(profile, config, Fixed(servers), arrivals)
    waits = result.ttft
    return float(np.mean(waits)), mmc_mean_wait(arrival_rate, service_rate, servers), waits, arrivals


def _mmc(args: argparse.Namespace) -> int:
    simulated, closed, _, _ = mmc_run(args.servers, args.load, args.requests, args.seed)
    print(f"M/M/{args.servers} at rho {args.load:g}, {args.requests:,} requests: mean wait simulated "
          f"{simulated:.4f} s, Erlang C {closed:.4f} s ({(simulated / closed - 1) * 100:+.2f}%)")
    return 0


def _profiles(args: argparse.Namespace) -> int:
    for name in available_profiles():
        p = CostProfile.load(name)
        print(f"{name} ({p.source}): step {p.step_base_s * 1000:.2f} ms + {p.per_seq_s * 1e6:.1f} us/seq, "
              f"prefill {p.prefill_tokens_per_s:,.0f} tokens/s, {p.max_num_seqs} seqs, cold start {p.cold_start_s:g} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    result: int = args.func(args)
    return result
