"""A real `sluice serve` with auth on, and Debian's chromium driven by Playwright, for the console test."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # gateway_server: starts real servers

from gateway_server import Server, start_server

ADMIN_KEY = "console-test-admin-key"  # test_web_console.py signs in with it
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parents[2] / "artifacts" / "web"


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """Debian's chromium, which `make test` installs (`make browser`)."""
    found = shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is not installed: run `make browser` (or `make test`, which does)")
    return found


# Module scope, not session: Playwright's sync API keeps an event loop running on this thread while
# it is open, and tests after this module call asyncio.run().
@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[object]:
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "SLUICE_ADMIN_KEY": ADMIN_KEY,
        "SLUICE_DATA_DIR": str(tmp_path_factory.mktemp("console-db")),  # a fresh SQLite database
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "SLUICE_USAGE_FLUSH_MS": "50",
    }
    options = ("--synthetic-tokens-per-second", "400", "--synthetic-ttft-ms", "5")
    yield from start_server(*options, auth=True, env=env)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
