"""`sluice bench gateway`: what the HTTP gateway costs over driving the engine directly.

This module owns the gateway-overhead benchmark. In one run it measures output tokens/s for
the same load twice:

(a) direct: `num_streams` requests of `input_len` random prompt tokens and `output_len`
    output tokens (ignore_eos) submitted at once to an in-process `LLMEngine`, configured
    as `sluice serve` configures it, stepped to completion (`benchmarks.engine.direct_streams`);
(b) gateway: the same load through a real `sluice serve --driver native` subprocess on a free
    port, driven by `benchmarks.serve.run_benchmark` (completions endpoint, vLLM's random prompts of
    `input_len` tokens, greedy, ignore_eos, `max_concurrency = num_streams`, streaming), started with
    `--no-auth`: the figure is HTTP + SSE + driver + engine process, without tenant auth, rate limits
    and usage writes (those need a tenant database and a key).

and prints both and the ratio gateway/direct (target >= 0.9). The server is stopped at the end,
on error too. The engine is imported lazily, so `sluice --help` does not load torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.config_options import (
    add_config_command,
    config_from_args,
    print_load_average,
    verdict,
    write_json,
)
from benchmarks.serve import BenchConfig, BenchResult, run_benchmark
from benchmarks.server_process import ServerProcess

DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # as engine_native.precision; this process stays torch-free

TARGET_RATIO = 0.9


@dataclass(frozen=True)
class GatewayBenchConfig:
    num_streams: int = 32
    input_len: int = 128
    output_len: int = 128
    dtype: str = "auto"
    threads: int = 2
    model: str | None = None  # None: the bundled model
    seed: int = 0
    startup_timeout_s: float = 300.0


QUICK = GatewayBenchConfig(num_streams=4, input_len=16, output_len=8)


@contextlib.contextmanager
def running_server(config: GatewayBenchConfig) -> Iterator[str]:
    """A native `sluice serve` until the block exits; yields its base URL."""
    options = ["--driver", "native", "--dtype", config.dtype, "--num-threads", str(config.threads)]
    if config.model:
        options += ["--model", config.model]
    with ServerProcess(options, startup_timeout_s=config.startup_timeout_s) as server:
        yield server.base_url


def through_gateway(config: GatewayBenchConfig) -> BenchResult:
    with running_server(config) as base:
        # Greedy, like the direct half; prompts of exactly input_len tokens of the served model.
        load = BenchConfig(base_url=base, endpoint="completions", tokenizer=config.model,
                           num_prompts=config.num_streams, input_len=config.input_len,
                           output_len=config.output_len, ignore_eos=True, temperature=0.0,
                           max_concurrency=config.num_streams, seed=config.seed, progress=False)
        asyncio.run(run_benchmark(BenchConfig(base_url=base, endpoint="completions", tokenizer=config.model,
                                              num_prompts=2, input_len=8, output_len=4, ignore_eos=True,
                                              temperature=0.0, progress=False)))  # warm-up
        return asyncio.run(run_benchmark(load))


def run(config: GatewayBenchConfig) -> dict[str, Any]:
    from benchmarks.engine import direct_streams  # lazy: torch loads only for this command

    direct = direct_streams(config.model, config.num_streams, config.input_len, config.output_len,
                            config.dtype, config.threads, config.seed)
    print(f"direct:  {direct['output_tok_s']:.1f} output tok/s ({direct['duration_s']:.2f} s)", flush=True)
    served = through_gateway(config)
    if served.failed or not served.completed:
        raise RuntimeError(f"gateway run had {served.failed} failed requests: {served.errors}")
    ratio = served.output_throughput / direct["output_tok_s"] if direct["output_tok_s"] > 0 else 0.0
    print(f"gateway: {served.output_throughput:.1f} output tok/s ({served.duration_s:.2f} s, "
          f"{served.total_input_tokens} prompt / {served.total_output_tokens} output tokens)")
    print(f"ratio gateway/direct: {ratio:.2f} (target >= {TARGET_RATIO}) -> {verdict(ratio >= TARGET_RATIO)}")
    load = print_load_average()
    return {"config": asdict(config), "direct": direct, "gateway": json.loads(served.to_json()),
            "ratio": ratio, "target": TARGET_RATIO, "met": ratio >= TARGET_RATIO, "load_average": load}


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_config_command(
        sub, "gateway", "gateway overhead: in-process engine vs the same load through sluice serve",
        GatewayBenchConfig(), run, options={
            "num_streams": "concurrent requests",
            "input_len": "prompt tokens per request",
            "output_len": "output tokens per request",
            "dtype": "engine dtype",
            "threads": "torch threads, both halves",
            "model": "model path; default: the bundled model",
        }, choices={"dtype": DTYPE_CHOICES})
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    p.set_defaults(func=_main)  # --quick: tiny sizes in place of the options'


def _main(args: argparse.Namespace) -> int:
    if args.quick:
        config = GatewayBenchConfig(**{**asdict(QUICK), "dtype": args.dtype, "threads": args.threads,
                                       "model": args.model})
    else:
        config = config_from_args(GatewayBenchConfig, args)
    write_json(run(config), args.json_out)
    return 0
