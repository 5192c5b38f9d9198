"""Observability overhead: output tokens/s with request metrics + OTLP traces/metrics on vs off.

`sluice bench observability [--driver native|synthetic] [--rounds 3]` starts two `sluice serve`
processes on free ports, identical except that one has SLUICE_TELEMETRY=0 and the other exports
traces and metrics over OTLP/HTTP to a sink process (which answers 200 and discards). Rounds
alternate off/on with the same load (`benchmarks.serve.run_benchmark`: 32 concurrent streams,
ignore_eos, completions, streaming) so drift on a shared machine hits both; it prints each round,
the median ratio on/off and whether it meets the target (>= 0.95). Servers stop at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from benchmarks.serve import BenchConfig, run_benchmark
from benchmarks.server_process import ServerProcess, free_port

TARGET = 0.95
_SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@contextmanager
def _sink(port: int) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", _SINK, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("observability", help="what telemetry costs: output tok/s with it on vs off",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--driver", default="native", choices=["native", "synthetic"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompts", type=int, default=64, help="requests per round")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--no-otlp", action="store_true", help="telemetry on = request metrics only, no export")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers below are stopped
    engine = (["--driver", "native", "--max-num-seqs", "32", "--kv-cache-memory", "256MiB", "--max-model-len", "512"]
              if args.driver == "native"
              else ["--driver", "synthetic", "--synthetic-tokens-per-second", "0", "--synthetic-ttft-ms", "0",
                    "--max-num-seqs", "256"])
    sink_port = free_port()
    bases = {}
    with ExitStack() as stack:
        stack.enter_context(_sink(sink_port))
        for mode, env in (("off", {"SLUICE_TELEMETRY": "0"}),
                          ("on", {} if args.no_otlp else {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}"})):
            bases[mode] = stack.enter_context(ServerProcess(engine, env=env)).base_url
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                config = BenchConfig(
                    base_url=bases[mode], endpoint="completions", num_prompts=args.prompts,
                    input_len=args.input_len, output_len=args.output_len, max_concurrency=args.streams,
                    ignore_eos=True, temperature=0.0, seed=r, progress=False,
                )
                result = asyncio.run(run_benchmark(config))
                rates[mode].append(result.output_throughput)
                print(f"round {r} telemetry {mode:3}: {result.output_throughput:8.1f} output tok/s "
                      f"({result.completed} ok, {result.failed} failed)", flush=True)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    ratio = statistics.median(ratios)
    summary = {
        "driver": args.driver, "streams": args.streams,
        "off_tok_s": [round(x, 1) for x in rates["off"]], "on_tok_s": [round(x, 1) for x in rates["on"]],
        "ratio_on_off_median": round(ratio, 4), "target": TARGET, "meets_target": ratio >= TARGET,
    }
    print(json.dumps(summary))
    return 0
