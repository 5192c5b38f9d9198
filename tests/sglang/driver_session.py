"""One SGLang driver's life around a test body: started on a config, handed to the body, stopped after,
whatever the body does. The stand-in tests and the opt-in test against a real server share it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from drivers.sglang.config import SGLangConfig
from drivers.sglang.driver import SGLangDriver

T = TypeVar("T")


def with_driver(config: SGLangConfig, body: Callable[[SGLangDriver], Awaitable[T]]) -> T:
    async def main() -> T:
        driver = SGLangDriver(config)
        await driver.start()
        try:
            return await body(driver)
        finally:
            await driver.stop()
    return asyncio.run(main())
