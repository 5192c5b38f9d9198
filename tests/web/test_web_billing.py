"""The console's billing views in headless Chromium against a real `sluice serve` whose relay sends to
the Stripe stand-in: the tenant's billed usage and the admin's relay tab show what the API reports."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_server import Server, start_server

sys.path.insert(0, str(Path(__file__).parents[1] / "billing"))  # the stand-in and the usage harness

from harness import COMPLETION_METER, PROMPT_METER, config, write_usage
from stripe_standin import RunningStandIn, StripeStandIn, serve

from tenants.db import create_engine, session_factory
from tests.polling import wait_until

ADMIN_KEY = "console-billing-admin-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def standin() -> Iterator[RunningStandIn]:
    running = serve(StripeStandIn({PROMPT_METER: "mtr_p", COMPLETION_METER: "mtr_c"}))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-billing-db")


@pytest.fixture(scope="module")
def billing_server(standin: RunningStandIn, data_dir: Path) -> Iterator[Server]:
    env = {
        "SLUICE_ADMIN_KEY": ADMIN_KEY, "SLUICE_DATA_DIR": str(data_dir), "DATABASE_URL": "", "REDIS_URL": "",
        "SLUICE_USAGE_FLUSH_MS": "50", "STRIPE_API_KEY": "sk_test_console",
        "SLUICE_STRIPE_API_BASE": standin.base_url, "SLUICE_BILLING_PROMPT_METER": PROMPT_METER,
        "SLUICE_BILLING_COMPLETION_METER": COMPLETION_METER, "SLUICE_BILLING_WINDOW_S": "60",
        "SLUICE_BILLING_SETTLE_S": "0", "SLUICE_BILLING_POLL_S": "0.1",
    }
    yield from start_server("--synthetic-tokens-per-second", "0", auth=True, env=env, startup_timeout_s=120)


def wait_for(fetch: Any, done: Any, what: str) -> Any:
    last: list[Any] = []

    def check() -> bool:
        last[:] = [fetch()]
        return bool(done(last[0]))

    wait_until(check, what, interval_s=0.1)
    return last[0]


def test_billed_usage_and_relay_state_in_the_console(
    browser: Any, billing_server: Server, standin: RunningStandIn, data_dir: Path, artifacts: Path
) -> None:
    base = billing_server.base_url
    http = httpx.Client(timeout=60)  # generous: a loaded 2-core machine answers slowly, never this slowly
    tenant = http.post(f"{base}/admin/tenants", json={"name": f"bill-{uuid.uuid4().hex[:6]}",
                                                        "stripe_customer_id": "cus_Console1"}, headers=ADMIN).json()
    key = http.post(f"{base}/admin/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=ADMIN).json()["key"]

    async def backfill() -> tuple[int, int]:  # usage of closed windows, through the real usage writer
        engine = create_engine(f"sqlite:///{data_dir.resolve() / 'sluice.db'}")
        try:
            cfg = config(standin)  # only its meters and window matter here
            return await write_usage(session_factory(engine), cfg, tenant["id"], 10, minutes_ago=20)
        finally:
            await engine.dispose()

    # In a thread of its own: Playwright's sync API keeps an event loop running on this one.
    with ThreadPoolExecutor(1) as pool:
        prompt, completion = pool.submit(asyncio.run, backfill()).result()
    state = wait_for(lambda: http.get(f"{base}/admin/billing", headers=ADMIN).json(),
                     lambda s: s["events"]["sent"]["tokens"] >= prompt + completion and not s["events"]["pending"]["events"],
                     "the server's relay to send")
    billed = http.get(f"{base}/v1/billing", headers={"authorization": f"Bearer {key}"}).json()
    sent = sum(d["sent"] for d in billed["data"])
    assert sent == standin.app.total(PROMPT_METER, "cus_Console1") + standin.app.total(COMPLETION_METER, "cus_Console1")

    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{base}/console/")
        page.fill("#key", key)
        page.click("form[data-form=sign-in] button[type=submit]")
        page.wait_for_selector("[data-view=billed-usage] [data-metric=billed_sent]")
        assert float(page.get_attribute("[data-metric=billed_sent]", "data-value")) == sent
        cells = page.eval_on_selector_all(
            "table[data-table=billed-usage] td[data-state=sent]", "els => els.map(e => Number(e.dataset.value))"
        )
        assert sum(cells) == sent
        page.screenshot(path=str(artifacts / "console-tenant-billing.png"), full_page=True)
        page.click("[data-action=sign-out]")

        page.fill("#key", ADMIN_KEY)
        page.click("form[data-form=sign-in] button[type=submit]")
        page.click("[data-tab=billing]")
        page.wait_for_selector("[data-view=relay-state] [data-metric=events_sent]")
        shown = float(page.get_attribute("[data-metric=events_sent]", "data-value"))
        assert shown >= state["events"]["sent"]["events"]
        assert page.text_content("[data-state=relay]") == "relay running here"
        page.screenshot(path=str(artifacts / "console-admin-relay.png"), full_page=True)
        page.click("[data-tab=tenants]")
        page.click(f"tr[data-tenant-id='{tenant['id']}']")
        page.wait_for_selector("form[data-form=stripe-customer] input")
        assert page.input_value("form[data-form=stripe-customer] input") == "cus_Console1"
        admin_sent = "[data-tenant-detail] [data-metric=billed_sent]"
        page.wait_for_selector(admin_sent)
        assert float(page.get_attribute(admin_sent, "data-value")) == sent
        page.screenshot(path=str(artifacts / "console-admin-billing.png"), full_page=True)
        assert not errors, errors
    finally:
        context.close()
