"""`sluice models ...`: the model registry's admin API from a shell (docs/versions.md).

Every subcommand is one or two HTTP calls to a running server (`--base-url`, `SLUICE_URL`) with the
admin key (`--admin-key`, `SLUICE_ADMIN_KEY`); the answer is printed as JSON. A refused call prints
the server's error and exits with 1.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from typing import Any

TIMEOUT_S = 900.0  # a deploy answers once the version is loaded and warm


def add_models_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="model versions: register, deploy, alias, rollback, retire (docs/versions.md)")
    p.add_argument("--base-url", default=os.environ.get("SLUICE_URL", "http://127.0.0.1:8000"),
                   help="the server (SLUICE_URL)")
    p.add_argument("--admin-key", default=os.environ.get("SLUICE_ADMIN_KEY"), help="(SLUICE_ADMIN_KEY)")
    p.add_argument("--actor", default=None, help="who makes the change, for the change log; default: $USER")
    cmds = p.add_subparsers(dest="models_command", required=True)
    cmds.add_parser("list", help="every registered model, its alias and versions")
    for name, help_ in (("show", "one model"), ("changes", "its change log, newest first")):
        c = cmds.add_parser(name, help=help_)
        c.add_argument("model")
    c = cmds.add_parser("register", help="register a version (a .gguf file or a Hugging Face folder)")
    c.add_argument("model")
    c.add_argument("version")
    c.add_argument("source")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    for name, help_ in (("deploy", "load and warm a version (every replica)"),
                        ("retire", "drain and unload a version no alias points at")):
        c = cmds.add_parser(name, help=help_)
        c.add_argument("model")
        c.add_argument("version")
    c = cmds.add_parser("alias", help="set the weights, e.g. `alias chat v1=90 v2=10`")
    c.add_argument("model")
    c.add_argument("weights", nargs="+", metavar="VERSION=PERCENT")
    c.add_argument("--generation", type=int, default=None,
                   help="the generation this replaces; default: the newest now (read first)")
    c = cmds.add_parser("rollback", help="the generation before the newest, as a new generation")
    c.add_argument("model")
    c.add_argument("--generation", type=int, default=None, help="the generation you saw; default: the newest")
    p.set_defaults(func=run_models)


def _weights(items: list[str]) -> dict[str, int]:
    weights = {}
    for item in items:
        version, sep, percent = item.partition("=")
        if not sep or not percent.strip().isdigit():
            raise SystemExit(f"weights are VERSION=PERCENT, not {item!r}")
        weights[version.strip()] = int(percent)
    return weights


def run_models(args: argparse.Namespace, _env: object = None) -> int:
    import httpx  # here: every `sluice` command, and each engine process `sluice serve` spawns, imports this module

    headers = {"x-sluice-actor": args.actor or getpass.getuser()}
    if args.admin_key:
        headers["authorization"] = f"Bearer {args.admin_key}"
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=TIMEOUT_S) as client:
        def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
            resp = client.request(method, path, json=body)
            if resp.status_code >= 400:
                print(resp.text, file=sys.stderr)
                raise SystemExit(1)
            return resp.json()

        m = getattr(args, "model", None)
        cmd = args.models_command
        if cmd == "list":
            out = call("GET", "/admin/registry")
        elif cmd == "show":
            out = call("GET", f"/admin/models/{m}")
        elif cmd == "changes":
            out = call("GET", f"/admin/models/{m}/changes")
        elif cmd == "register":
            out = call("POST", f"/admin/models/{m}/versions",
                       {"version": args.version, "source": os.path.abspath(args.source), "dtype": args.dtype})
        elif cmd == "deploy":
            out = call("POST", f"/admin/models/{m}/versions/{args.version}/deploy")
        elif cmd == "retire":
            out = call("POST", f"/admin/models/{m}/versions/{args.version}/retire")
        elif cmd == "alias":
            generation = args.generation
            if generation is None:
                alias = call("GET", f"/admin/models/{m}")["alias"]
                generation = alias["generation"] if alias else 0
            out = call("PUT", f"/admin/models/{m}/alias", {"weights": _weights(args.weights), "generation": generation})
        else:  # rollback
            out = call("POST", f"/admin/models/{m}/rollback", {"generation": args.generation})
    print(json.dumps(out, indent=2))
    return 0
