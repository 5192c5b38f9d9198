"""The `sluice` command: `sluice serve` runs the gateway; `sluice bench <name>` runs a benchmark;
`sluice billing relay|reconcile` sends usage to Stripe and checks it (billing/cli.py).

The benchmarks live in the top-level `benchmarks` package, which no product code imports:
`sluice bench ...` replaces this process with `python -m benchmarks ...`. Defaults of `serve`
come from the environment via `Settings`, read here once."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from drivers.options import EngineOptions
from gateway.models_cli import add_models_command
from gateway.settings import Settings, comma_list
from gateway.sglang_cli import add_sglang_arguments, sglang_config

if TYPE_CHECKING:
    from drivers.fleet.config import FleetConfig
    from observability.node_health import NodeHealthConfig

log = logging.getLogger("sluice.cli")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'512MiB', '2G', '1048576' -> bytes (binary multiples: K = 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    value, unit = float(match.group(1)), (match.group(2) or "b").lower()
    return int(value * 1024 ** "bkmgt".index(unit[0]))


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, not {text}")
    return value


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser], env: Settings) -> None:
    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=env.host, help="interface to bind (SLUICE_HOST)")
    p.add_argument("--port", type=int, default=env.port, help="TCP port (SLUICE_PORT)")
    p.add_argument("--driver", default=env.driver, help="engine driver: native, synthetic, fleet or sglang (SLUICE_DRIVER)")
    p.add_argument(
        "--no-load-shedding",
        dest="load_shedding",
        action="store_false",
        default=env.load_shedding,
        help="no early 503s from estimated queue waits; only the queue bounds (SLUICE_LOAD_SHEDDING=0)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=env.max_body_bytes,
        help="largest request body; larger gets 413 (SLUICE_MAX_BODY_BYTES)",
    )
    p.add_argument(
        "--stream-timeout",
        type=float,
        default=env.stream_timeout_s,
        help="lifetime cap of one generation in seconds (SLUICE_STREAM_TIMEOUT_S)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=env.keep_alive_timeout_s,
        help="seconds an idle client connection is kept open; keep it above the clients' and load balancers' "
        "idle timeouts (SLUICE_KEEP_ALIVE_TIMEOUT_S)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=env.drain_timeout_s,
        help="on SIGTERM, seconds requests in flight may run on before they are ended (SLUICE_DRAIN_TIMEOUT_S)",
    )
    p.add_argument(
        "--no-auth",
        dest="auth",
        action="store_false",
        default=env.auth,
        help="dev only: no tenants, keys, limits or usage records (SLUICE_AUTH=0)",
    )
    p.add_argument("--log-level", default=env.log_level, help="DEBUG, INFO, WARNING, ... (SLUICE_LOG_LEVEL)")
    add_engine_arguments(p, env)
    _add_fleet_arguments(p, env)
    add_sglang_arguments(p, env)
    p.set_defaults(func=_serve)


def add_engine_arguments(p: argparse.ArgumentParser, env: Settings) -> None:
    """The engine's flags, shared by `sluice serve` and `sluice worker` (read back by `engine_options`).

    They default to None: the value comes from the environment when set there, else from the driver's
    own defaults (engine_native/config.py for the native engine), so each lives in one place."""
    e = env.engine
    p.add_argument(
        "--model",
        default=e.model,
        help="model path for the native driver; default: the bundled model (SLUICE_MODEL)",
    )
    p.add_argument("--served-model-name", default=None, help="model id clients send; default: the driver's")
    p.add_argument(
        "--dtype", default=None, choices=["auto", "bfloat16", "float32"],
        help="weight/activation dtype; default: the engine's (auto: bfloat16 only on CPUs with native bf16, "
        "AVX-512 BF16 or AMX)"
    )
    p.add_argument(
        "--device", default=None, choices=["auto", "cpu", "cuda"],
        help="where the native engine computes; default: the engine's (auto: cuda when torch sees a GPU, "
        "which the default CPU build of torch never does; docs/engine.md, GPU)"
    )
    p.add_argument(
        "--attention-backend", default=None, choices=["auto", "native", "sdpa", "flashinfer"],
        help="paged attention of the native engine; default auto: native on CPU, flashinfer on CUDA when "
        "installed, else sdpa"
    )
    p.add_argument(
        "--prefill-attention-dtype", default=None, choices=["float32", "float32-sdpa", "kv"],
        help="what the native CPU path's prefill attention computes in; default float32 (as decodes compute: "
        "a recomputed request keeps its greedy tokens; on AMX CPUs with a bf16 cache Sluice's split-bf16 "
        "kernel, within 2^-17 of fp32); float32-sdpa: PyTorch's fp32 SDPA everywhere; kv: the KV cache's "
        "dtype, q and the softmax probabilities rounded to bf16 (docs/engine.md, Numerics)"
    )
    p.add_argument(
        "--bf16-panel-max-rows", type=_non_negative_int, default=None,
        help="pure-decode steps of up to this many sequences multiply by the bf16 weights laid out for AVX-512 "
        "BF16 dot products where the CPU has them and no AMX (a second copy of the dense weights), 0: oneDNN "
        "only; default: the engine's (256)"
    )
    p.add_argument(
        "--int8-activation-max-rows", type=_non_negative_int, default=None,
        help="the native engine's steps of at most this many tokens (the single stream: 1) round each token's "
        "activations to int8 blocks of 32 and multiply them by the model's 4- and 8-bit weights in integer "
        "multiply-adds, as llama.cpp does: faster decodes on CPUs without AVX-512, at 8-bit activations' "
        "accuracy; default 0: never"
    )
    p.add_argument(
        "--int16-activation-max-rows", type=_non_negative_int, default=None,
        help="the native engine's steps of at most this many tokens round each token's activations to int16 "
        "blocks of 32 (65,535 steps of the block's largest magnitude) and multiply them in integer multiply-adds; "
        "0: fp32 products; default: 2 on CPUs without AVX-512, 0 on those with it"
    )
    p.add_argument(
        "--kv-dtype", choices=["bfloat16", "float32"], default=None,
        help="the native engine's KV cache dtype; bfloat16 halves the bytes each decode step reads; default: the "
        "engine's (docs/engine.md, Knobs)"
    )
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="cap on sequences running in one engine step; default: the engine's")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="processes each engine's model is split across (docs/parallelism.md); default 1")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step; default: the engine's")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV cache pool size, e.g. 2GiB; default: a fraction of free memory",
    )
    p.add_argument(
        "--model-memory-budget",
        type=parse_bytes,
        default=env.engine.model_memory_budget_bytes,
        help="memory all hosted model versions may take together (weights + KV pools), e.g. 8GiB; a deploy "
             "beyond it is refused; default: the host's memory (SLUICE_MODEL_MEMORY_BUDGET)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap; default: the model's")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads; default: torch's choice")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=e.max_waiting,
        help="queued requests beyond the running ones before 503 (SLUICE_MAX_WAITING); default: the engine's",
    )
    p.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=e.max_waiting_tokens,
        help="queued prompt tokens before 503, 0: no bound (SLUICE_MAX_WAITING_TOKENS); default: the engine's",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="largest prefill chunk of one request per step (lower: steadier decode latency); default: the engine's",
    )
    p.add_argument(
        "--wave-budget-factor",
        type=int,
        default=None,
        help="times the step budget a step may take while at most one request decodes and requests wait "
             "(a burst then starts in one step), 1: off; default: the engine's",
    )
    p.add_argument(
        "--prefill-tokens-beside-decodes",
        type=int,
        default=None,
        help="prompt tokens a step computes while streams decode, 0: no cap (lower: steadier inter-token "
             "latency, longer TTFT); default: the engine's",
    )
    p.add_argument(
        "--prompt-order-ms-per-token",
        type=_non_negative_float,
        default=None,
        help="waiting requests stand in line by arrival plus this many ms per prompt token (a burst goes "
             "shortest prompt first), 0: arrival order; default: the engine's",
    )
    p.add_argument(
        "--burst-hold-ms",
        type=_non_negative_float,
        default=None,
        help="an idle engine holds its first step up to this long for requests of the same burst still being "
             "tokenized, so the burst is prefilled in one step; 0: off; default: the engine's",
    )
    p.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
        help="do not reuse KV of shared prefixes",
    )
    p.add_argument(
        "--step-trace", metavar="DIR", default=None,
        help="every engine appends a JSON line per step to DIR/<node id>.jsonl (what each step held, how long "
             "it took); summarize one with `sluice bench steps FILE`",
    )
    p.add_argument(
        "--synthetic-tokens-per-second",
        type=float,
        default=None,
        help="synthetic driver: decode rate per request (0 = unthrottled); default: the driver's",
    )
    p.add_argument(
        "--synthetic-ttft-ms", type=float, default=None, help="synthetic driver: time to first token; default: the driver's"
    )
    p.add_argument(
        "--synthetic-start-delay", type=float, default=None,
        help="synthetic driver: seconds before it turns ready, like a model load (a worker's cold start)",
    )
    _add_node_arguments(p)
    _add_restart_arguments(p, env)


def _add_fleet_arguments(p: argparse.ArgumentParser, env: Settings) -> None:
    from drivers.fleet.breaker import BreakerConfig
    from drivers.fleet.config import FleetConfig, FleetTimeouts
    from drivers.fleet.router import Policy, RouterConfig

    t, r, b = FleetTimeouts(), RouterConfig(), BreakerConfig()
    g = p.add_argument_group("fleet (--driver fleet: engines in `sluice worker` processes; see docs/fleet.md)")
    g.add_argument("--workers", default=",".join(env.fleet_workers), metavar="URL,...",
                   help="static worker base URLs, comma-separated (SLUICE_WORKERS)")
    g.add_argument("--fleet-redis", default=env.fleet_redis_url, metavar="URL",
                   help="Redis the workers register in (SLUICE_FLEET_REDIS_URL)")
    g.add_argument("--fleet-policy", default=env.fleet_policy, choices=[str(x) for x in Policy],
                   help="how a worker is picked (SLUICE_FLEET_POLICY)")
    g.add_argument("--fleet-max-attempts", type=int, default=FleetConfig.max_attempts,
                   help="workers one request may be tried on")
    g.add_argument("--fleet-connect-timeout", type=float, default=t.connect_s, help="seconds to connect to a worker")
    g.add_argument("--fleet-stall-timeout", type=float, default=t.stall_s,
                   help="seconds of silence (no token, no keepalive) after which a worker is hung")
    g.add_argument("--fleet-first-token-timeout", type=float, default=t.first_token_s,
                   help="seconds a worker may take to the first token")
    g.add_argument("--fleet-inter-token-timeout", type=float, default=t.inter_token_s,
                   help="seconds a worker may take between two tokens")
    g.add_argument("--fleet-load-factor", type=float, default=r.load_factor,
                   help="prefix affinity's bounded load: a worker takes at most this times the mean")
    g.add_argument("--fleet-breaker-failures", type=int, default=b.failures_to_open,
                   help="consecutive failures that open a worker's circuit")
    g.add_argument("--fleet-breaker-open", type=float, default=b.open_s,
                   help="seconds an open circuit keeps a worker out before a probe")


def fleet_config(args: argparse.Namespace, env: Settings, node_health: NodeHealthConfig) -> FleetConfig:
    try:
        return _fleet_config(args, env, node_health)
    except ValueError as exc:  # a misconfigured fleet is a usage error, not a traceback
        raise SystemExit(f"sluice: {exc}") from None


def _fleet_config(args: argparse.Namespace, env: Settings, node_health: NodeHealthConfig) -> FleetConfig:
    from drivers.fleet.breaker import BreakerConfig
    from drivers.fleet.config import FleetConfig, FleetTimeouts
    from drivers.fleet.router import Policy, RouterConfig

    return FleetConfig(
        workers=comma_list(args.workers),
        redis_url=args.fleet_redis or None,
        secret=env.fleet_secret,
        tls_verify=env.fleet_ca or True,
        router=RouterConfig(policy=Policy(args.fleet_policy), load_factor=args.fleet_load_factor),
        timeouts=FleetTimeouts(
            connect_s=args.fleet_connect_timeout, stall_s=args.fleet_stall_timeout,
            first_token_s=args.fleet_first_token_timeout, inter_token_s=args.fleet_inter_token_timeout,
        ),
        breaker=BreakerConfig(failures_to_open=args.fleet_breaker_failures, open_s=args.fleet_breaker_open),
        node_health=node_health,
        max_attempts=args.fleet_max_attempts,
        sglang=sglang_config(args, env, node_health) if comma_list(args.sglang_servers) else None,
    )


def _add_node_arguments(p: argparse.ArgumentParser) -> None:
    from observability.node_health import NodeHealthConfig

    d = NodeHealthConfig()
    g = p.add_argument_group("engine nodes (native driver; see docs/observability.md)")
    g.add_argument("--engines", type=int, default=None, help="engine processes (nodes node-0..N-1); default: one")
    g.add_argument(
        "--fault-step-delay", action="append", default=[], metavar="NODE=SECONDS",
        help="chaos testing: extra sleep after every engine step of NODE (repeatable)",
    )
    g.add_argument("--node-window", type=float, default=d.window_s, help="health window, seconds")
    g.add_argument("--node-min-samples", type=int, default=d.min_samples, help="ITL samples to judge a node")
    g.add_argument("--node-min-ratio", type=float, default=d.min_ratio,
                   help="latency vs peers at comparable load that counts as slow")
    g.add_argument("--node-flag-after", type=int, default=d.flag_after, help="slow evaluations (1/s) to flag")
    g.add_argument("--node-unflag-after", type=int, default=d.unflag_after,
                   help="recovered evaluations (1/s) to unflag")
    g.add_argument("--node-stall-after", type=float, default=d.stall_after_s,
                   help="seconds without a token, with work in flight, before a node is stalled")


def _add_restart_arguments(p: argparse.ArgumentParser, env: Settings) -> None:
    from drivers.supervisor import RestartPolicy

    d = env.engine.restart or RestartPolicy()
    g = p.add_argument_group("engine supervision (native driver; see docs/observability.md)")
    g.add_argument("--engine-restart-backoff", type=float, default=d.backoff_initial_s,
                   help="seconds before restarting a dead engine, doubling per death (SLUICE_ENGINE_RESTART_BACKOFF_S)")
    g.add_argument("--engine-restart-backoff-max", type=float, default=d.backoff_max_s,
                   help="cap of the restart backoff, seconds")
    g.add_argument("--engine-max-failures", type=int, default=d.max_failures,
                   help="engine deaths within the window that make a crash loop: give up, /healthz 503 "
                        "(SLUICE_ENGINE_MAX_FAILURES)")
    g.add_argument("--engine-failure-window", type=float, default=d.failure_window_s,
                   help="the crash-loop window, seconds (SLUICE_ENGINE_FAILURE_WINDOW_S)")


def engine_options(args: argparse.Namespace, env: Settings | None = None) -> EngineOptions:
    """The engine's knobs from the parsed `serve` flags (whose defaults already hold the environment)."""
    from drivers.supervisor import RestartPolicy
    from observability.node_health import NodeHealthConfig

    delays = {}
    for item in args.fault_step_delay:
        node, sep, seconds = item.partition("=")
        if not sep:
            raise SystemExit(f"--fault-step-delay wants NODE=SECONDS, not {item!r}")
        delays[node.strip()] = float(seconds)
    health = NodeHealthConfig(
        window_s=args.node_window, min_samples=args.node_min_samples, min_ratio=args.node_min_ratio,
        flag_after=args.node_flag_after, unflag_after=args.node_unflag_after, stall_after_s=args.node_stall_after,
    )
    ttft_ms = args.synthetic_ttft_ms
    return EngineOptions(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        prefill_attention_dtype=args.prefill_attention_dtype,
        bf16_panel_max_rows=args.bf16_panel_max_rows,
        int8_activation_max_rows=args.int8_activation_max_rows,
        int16_activation_max_rows=args.int16_activation_max_rows,
        kv_dtype=args.kv_dtype,
        num_threads=args.num_threads,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        wave_budget_factor=args.wave_budget_factor,
        prefill_tokens_beside_decodes=args.prefill_tokens_beside_decodes,
        prompt_order_ms_per_token=args.prompt_order_ms_per_token,
        burst_hold_ms=args.burst_hold_ms,
        max_waiting=args.max_waiting,
        max_waiting_tokens=args.max_waiting_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory,
        model_memory_budget_bytes=args.model_memory_budget,
        enable_prefix_caching=args.prefix_caching,
        step_trace_dir=args.step_trace,
        num_engines=args.engines,
        tensor_parallel_size=args.tensor_parallel_size,
        node_health=health,
        restart=RestartPolicy(
            backoff_initial_s=args.engine_restart_backoff,
            backoff_max_s=args.engine_restart_backoff_max,
            max_failures=args.engine_max_failures,
            failure_window_s=args.engine_failure_window,
        ),
        fault_step_delay=delays,
        synthetic_tokens_per_second=args.synthetic_tokens_per_second,
        synthetic_ttft_s=ttft_ms / 1000.0 if ttft_ms is not None else None,
        synthetic_start_delay_s=args.synthetic_start_delay,
        fleet=fleet_config(args, env or Settings(), health) if getattr(args, "driver", None) == "fleet" else None,
        sglang=sglang_config(args, env or Settings(), health) if getattr(args, "driver", None) == "sglang" else None,
    )


def _serve(args: argparse.Namespace, env: Settings) -> int:
    from drivers.registry import create_driver
    from gateway.logs import configure_logging

    settings = replace(
        env,
        host=args.host,
        port=args.port,
        driver=args.driver,
        engine=engine_options(args, env),
        load_shedding=args.load_shedding,
        max_body_bytes=args.max_body_bytes,
        stream_timeout_s=args.stream_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level.upper(),
        auth=args.auth,
    )
    configure_logging(settings.log_level, log_prompts=settings.log_prompts)
    driver = create_driver(settings.driver, settings.engine)
    # The native engines load their model while the gateway imports its web framework, stores and metrics
    # (~1.5 s before its lifespan would start them).
    driver.begin_start()

    import uvicorn

    from gateway.app import create_app
    from gateway.drain import Drain, DrainingServer
    from gateway.server_choice import SERVER_HTTP, SERVER_LOOP

    app = create_app(settings, driver)
    base = f"http://{settings.host}:{settings.port}"
    log.info("starting", extra={"address": base, "driver": settings.driver, "model": settings.engine.model})
    auth_header = "-H \"authorization: Bearer $SLUICE_KEY\" " if settings.auth else ""
    print(
        f"Sluice listening on {base} (driver {settings.driver}, auth {'on' if settings.auth else 'off'}). Try:\n"
        f"  curl {base}/v1/chat/completions {auth_header}-H 'content-type: application/json' "
        f'-d \'{{"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}\'',
        flush=True,
    )
    if settings.auth:
        print(
            "  with SLUICE_KEY a tenant key from the admin API (POST /admin/tenants, then\n"
            "  POST /admin/tenants/<id>/keys, with the admin key; see README 'Tenants'). --no-auth turns auth off.",
            flush=True,
        )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,  # after the drain (gateway/drain.py): only idle connections are left
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # seconds, float too
        loop=SERVER_LOOP,
        http=SERVER_HTTP,
    )
    drain: Drain = app.state["drain"]
    DrainingServer(config, drain).run()
    return drain.exit_code


def build_parser(env: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: multi-tenant LLM inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub, env)
    from billing.cli import add_billing_commands

    add_billing_commands(sub, lambda: _database_url(env))
    from worker.cli import add_worker_parser

    add_worker_parser(sub, env)
    add_models_command(sub)
    # Listed here for `sluice --help`; main() hands everything after `bench` to the benchmarks package.
    sub.add_parser("bench", add_help=False, help="benchmarks (sluice bench --help lists them)")
    sub.add_parser("simulate", add_help=False,
                   help="the fleet simulator: scaling policies through a day of traffic (sluice simulate --help)")
    return parser


def _database_url(env: Settings) -> str:
    from gateway.tenancy import database_url  # SQLAlchemy and the tenants' stores: only for a billing command

    return database_url(env)


def _run_benchmarks(args: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *args])


def _run_simulator(args: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, "-m", "simulator", *args])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        _run_benchmarks(argv[1:])
    if argv[:1] == ["simulate"]:
        _run_simulator(argv[1:])
    env = Settings.from_env()
    args = build_parser(env).parse_args(argv)
    result: int = args.func(args, env)
    return result


if __name__ == "__main__":
    sys.exit(main())
