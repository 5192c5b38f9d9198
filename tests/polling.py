"""Waiting in tests for a state to hold, by polling it.

The deadline is not a speed bound: it only turns a hang into a failure that names what never
happened (the suite asserts no wall-clock figures; those live in benchmarks/).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

HANG_S = 120.0


class Hung(AssertionError):
    """What a test waited for never came."""


def wait_until(check: Callable[[], T], what: str, timeout_s: float = HANG_S, interval_s: float = 0.05) -> T:
    """Call `check` until it returns something truthy, and return that."""
    give_up = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > give_up:
            raise Hung(f"hung waiting for {what}")
        time.sleep(interval_s)
    return result


async def await_until(check: Callable[[], Awaitable[T]], what: str, timeout_s: float = HANG_S,
                      interval_s: float = 0.02) -> T:
    """`wait_until` for an async check, sleeping without blocking the event loop."""
    give_up = time.monotonic() + timeout_s
    while not (result := await check()):
        if time.monotonic() > give_up:
            raise Hung(f"hung waiting for {what}")
        await asyncio.sleep(interval_s)
    return result
