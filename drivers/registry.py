"""Driver registry: names to factories, so the CLI and config pick an engine by name.

A factory takes the service's `EngineOptions` and builds the driver from them. Heavy drivers are
registered as "module:attribute" strings (the attribute may be dotted: "Class.from_options") and
imported only when created, so `import drivers.registry` never pulls torch in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import reduce
from typing import Any

from drivers.base import Driver
from drivers.options import EngineOptions

DriverFactory = Callable[[EngineOptions], Driver]

# name -> factory, or "package.module:Attribute" resolved lazily on first use.
_REGISTRY: dict[str, DriverFactory | str] = {
    "synthetic": "drivers.synthetic:SyntheticDriver.from_options",
    # The native engine as a version host: the model it starts with, plus versions the registry loads.
    "native": "drivers.native_versions:versioned_native_driver",
    "fleet": "drivers.fleet.driver:FleetDriver.from_options",
    "sglang": "drivers.sglang.driver:SGLangDriver.from_options",
}


def register_driver(name: str, factory: DriverFactory | str) -> None:
    """Register (or replace) a driver factory under `name`."""
    _REGISTRY[name] = factory


def available_drivers() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(name: str) -> DriverFactory:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown driver {name!r}; available: {', '.join(available_drivers())}") from None
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        target: Any = importlib.import_module(module_name)
        factory: DriverFactory = reduce(getattr, attr.split("."), target)
        _REGISTRY[name] = factory
        return factory
    return entry


def create_driver(name: str, options: EngineOptions | None = None) -> Driver:
    """Build the driver registered as `name` from the service's engine options (None: all defaults)."""
    return _resolve(name)(options or EngineOptions())
