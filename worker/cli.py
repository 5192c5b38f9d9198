"""`sluice worker`: its flags (the engine's are `sluice serve`'s), read once into `WorkerSettings`."""

from __future__ import annotations

import argparse
import os
import socket

from gateway.settings import Settings


def add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], env: Settings) -> None:
    from gateway.cli import add_engine_arguments

    d = os.environ
    p = sub.add_parser(
        "worker",
        help="serve engine nodes to a fleet of gateways (docs/fleet.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=d.get("SLUICE_WORKER_HOST", "127.0.0.1"), help="interface to bind")
    p.add_argument("--port", type=int, default=int(d.get("SLUICE_WORKER_PORT", "8100")), help="TCP port")
    p.add_argument("--worker-id", default=d.get("SLUICE_WORKER_ID") or None,
                   help="stable name in the fleet (SLUICE_WORKER_ID); default: <hostname>-<port>")
    p.add_argument("--advertise-url", default=None, help="base URL gateways reach it at; default: http(s)://host:port")
    p.add_argument("--driver", default="native", choices=["native", "synthetic"], help="the engine it hosts")
    p.add_argument("--redis", dest="fleet_redis", default=env.fleet_redis_url,
                   help="register and heartbeat in this Redis (SLUICE_FLEET_REDIS_URL); default: none (static lists)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds the requests in flight may run before the worker exits anyway")
    p.add_argument("--keep-alive-timeout", type=float, default=75.0,
                   help="seconds an idle gateway connection is kept open (above the gateways' pool expiry)")
    p.add_argument("--stream-interval-ms", type=float, default=0.0,
                   help="least milliseconds between two token frames of a stream (tokens meanwhile share one "
                        "frame); 0: send what is ready whenever the stream is written")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between Redis heartbeats")
    p.add_argument("--heartbeat-ttl", type=float, default=2.5,
                   help="seconds without a heartbeat before the worker drops out of the fleet")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (uvicorn's); with --ssl-certfile: https")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (uvicorn's)")
    p.add_argument("--log-level", default=env.log_level, help="DEBUG, INFO, WARNING, ...")
    add_engine_arguments(p, env)
    p.set_defaults(func=_worker)


def _worker(args: argparse.Namespace, env: Settings) -> int:
    from drivers.registry import create_driver
    from gateway.cli import engine_options
    from gateway.logs import configure_logging
    from worker.settings import WorkerSettings

    scheme = "https" if args.ssl_certfile else "http"
    settings = WorkerSettings(
        host=args.host,
        port=args.port,
        worker_id=args.worker_id or f"{socket.gethostname()}-{args.port}",
        advertise_url=args.advertise_url or f"{scheme}://{args.host}:{args.port}",
        driver=args.driver,
        engine=engine_options(args, env),
        fleet_secret=env.fleet_secret,
        redis_url=args.fleet_redis,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_ttl_s=args.heartbeat_ttl,
        drain_timeout_s=args.drain_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        stream_interval_s=args.stream_interval_ms / 1000,
        log_level=args.log_level.upper(),
        otlp_endpoint=env.otlp_endpoint,
        service_name=os.environ.get("OTEL_SERVICE_NAME") or "sluice-worker",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    configure_logging(settings.log_level)
    driver = create_driver(settings.driver, settings.engine)
    driver.begin_start()  # the engines load their model while the worker imports its server (~0.4 s)
    from worker.server import run_worker

    return run_worker(settings, driver)
