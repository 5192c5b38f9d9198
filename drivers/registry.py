"""Driver registry: names to factories, so the CLI and config pick an engine by name.

Heavy drivers are registered as "module:attribute" strings and imported only
when created, so `import drivers.registry` never pulls torch in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from drivers.base import Driver

DriverFactory = Callable[..., Driver]

# name -> factory, or "package.module:Attribute" resolved lazily on first use.
_REGISTRY: dict[str, DriverFactory | str] = {
    "synthetic": "drivers.synthetic:SyntheticDriver",
    "native": "drivers.native:NativeDriver",
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
        factory: DriverFactory = getattr(importlib.import_module(module_name), attr)
        _REGISTRY[name] = factory
        return factory
    return entry


def create_driver(name: str, **options: Any) -> Driver:
    """Build the driver registered as `name` with its constructor options."""
    return _resolve(name)(**options)
