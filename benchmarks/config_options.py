"""The command line of a benchmark run from a frozen config dataclass (`sluice bench fleet | fleet-failover |
fleet-affinity | gateway`), and the lines every such report ends with.

An option is a field of the config: `--kebab-name`, the field's default and its type (int, float, str), so
the benchmark declares each option once, as a help text, and the config is built back from the parsed
options. Fields without a help text are not options (they keep their default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

C = TypeVar("C")


def add_config_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
                       defaults: C, run: Callable[[C], dict[str, Any]], options: Mapping[str, str],
                       choices: Mapping[str, Sequence[str]] | None = None) -> argparse.ArgumentParser:
    """`sluice bench <name>`: an option per field named in `options` (field -> help), in that order, defaulting
    to its value in `defaults`, then --json-out; it runs `run(config)` and writes the report it returns there."""
    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field, help_text in options.items():
        default = getattr(defaults, field)
        if isinstance(default, bool):  # type=bool would take any non-empty word, "false" too, as True
            raise TypeError(f"{field}: a flag is no value option; add it with action='store_true'")
        p.add_argument(f"--{field.replace('_', '-')}", type=str if default is None else type(default),
                       default=default, choices=(choices or {}).get(field), help=help_text)
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    p.set_defaults(func=functools.partial(_run_config, run, type(defaults)))
    return p


def _run_config(run: Callable[[C], dict[str, Any]], config_type: type[C], args: argparse.Namespace) -> int:
    write_json(run(config_from_args(config_type, args)), args.json_out)
    return 0


def config_from_args(config_type: type[C], args: argparse.Namespace) -> C:
    """The config of the parsed options; a field that is no option keeps its default."""
    names = [f.name for f in dataclasses.fields(config_type)]  # type: ignore[arg-type]
    return config_type(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def write_json(report: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def print_load_average() -> tuple[float, float, float]:
    """Printed under the figures, which move with what else the host runs; returned for the JSON."""
    load = os.getloadavg()
    print(f"load average (1/5/15 min): {load} -- figures measured under that load")
    return load
