"""The web console in headless Chromium against a real `sluice serve --driver synthetic` with auth on.

A tenant signs in and sees charts whose numbers are the ones /v1/usage reports; the admin signs
in, issues and revokes keys in the UI, and the API then refuses the revoked key. Screenshots go to
artifacts/web/."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_server import Server

ADMIN_KEY = "console-test-admin-key"  # the server fixture (conftest.py) starts with this one
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
REQUESTS = 5


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(server: Server, key: str, max_tokens: int = 6) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hello console"}], "max_tokens": max_tokens}
    return httpx.post(f"{server.v1}/chat/completions", json=body, headers=bearer(key), timeout=30)


def admin_post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}{path}", json=body, headers=ADMIN)
    assert response.status_code == 201, response.text
    data: dict[str, Any] = response.json()
    return data


@pytest.fixture(scope="module")
def tenant(server: Server) -> dict[str, Any]:
    """A tenant with two keys and REQUESTS completed chats, once its usage is visible in the API."""
    t = admin_post(server, "/admin/tenants", {"name": f"acme-{uuid.uuid4().hex[:6]}", "max_concurrent": None})
    main = admin_post(server, f"/admin/tenants/{t['id']}/keys", {"name": "main"})
    spare = admin_post(server, f"/admin/tenants/{t['id']}/keys", {"name": "spare"})
    for i in range(REQUESTS):
        assert chat(server, main["key"], max_tokens=4 + i).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        usage = httpx.get(
            f"{server.v1}/usage", params={"group_by": "day"}, headers=bearer(main["key"])
        ).json()
        if sum(b["requests"] for b in usage["data"]) == REQUESTS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {"tenant": t, "main": main, "spare": spare}


def open_console(browser: Any, server: Server) -> tuple[Any, Any, list[str]]:
    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    # Waits only catch hangs: a loaded 2-core CI host can take tens of seconds to render.
    context.set_default_timeout(120_000)
    page = context.new_page()
    seen: list[str] = []  # console lines and request URLs: a key must never show up in either
    page.on("console", lambda m: seen.append(m.text))
    page.on("pageerror", lambda e: seen.append(f"pageerror: {e}"))
    page.on("request", lambda r: seen.append(r.url))
    page.goto(f"{server.base_url}/console/")
    return context, page, seen


def sign_in(page: Any, key: str) -> None:
    page.fill("#key", key)
    page.click("form[data-form=sign-in] button[type=submit]")


def value(page: Any, selector: str) -> float:
    page.wait_for_selector(selector, state="attached")
    return float(page.get_attribute(selector, "data-value"))


def test_tenant_sees_its_usage_and_latency_as_charts(
    browser: Any, server: Server, tenant: dict[str, Any], artifacts: Path
) -> None:
    key = tenant["main"]["key"]
    usage_day = httpx.get(f"{server.v1}/usage", params={"group_by": "day"}, headers=bearer(key)).json()
    usage_model = httpx.get(f"{server.v1}/usage", params={"group_by": "model"}, headers=bearer(key)).json()
    latency = httpx.get(f"{server.v1}/usage/latency", headers=bearer(key)).json()
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    [day] = usage_day["data"]
    assert day["group"] == today and day["requests"] == REQUESTS
    assert latency["overall"]["requests"] == REQUESTS
    assert latency["overall"]["latency_ms"]["p50"] <= latency["overall"]["latency_ms"]["p99"]

    context, page, seen = open_console(browser, server)
    try:
        sign_in(page, key)
        page.wait_for_selector("svg[data-chart=requests-per-day]")
        assert page.text_content("[data-state=who]") == "Tenant"
        bar = f"svg[data-chart=requests-per-day] rect[data-category='{today}'][data-series=requests]"
        assert value(page, bar) == REQUESTS
        tokens = f"svg[data-chart=tokens-per-day] rect[data-category='{today}']"
        assert value(page, f"{tokens}[data-series=prompt_tokens]") == day["prompt_tokens"]
        assert value(page, f"{tokens}[data-series=completion_tokens]") == day["completion_tokens"]
        for b in usage_model["data"]:
            model = f"svg[data-chart=tokens-per-model] rect[data-category='{b['group']}']"
            assert value(page, f"{model}[data-series=completion_tokens]") == b["completion_tokens"]
        for metric in ("requests", "prompt_tokens", "completion_tokens", "total_tokens"):
            assert value(page, f"[data-metric={metric}]") == day[metric]
        pct = "svg[data-chart=latency-percentiles] rect[data-category='{}'][data-series={}]"
        for q in ("p50", "p90", "p99"):
            assert value(page, pct.format("End to end", q)) == latency["overall"]["latency_ms"][q]
            assert value(page, pct.format("TTFT", q)) == latency["overall"]["ttft_ms"][q]
        dot = f"svg[data-chart=latency-per-day] circle[data-category='{today}'][data-series=p99]"
        assert value(page, dot) == latency["data"][0]["latency_ms"]["p99"]
        # Numbers the user reads, not only attributes: the stat card shows the request count.
        assert page.text_content("[data-metric=requests] .stat-value") == str(REQUESTS)

        assert page.evaluate("sessionStorage.getItem('sluice.console.key')") == key
        assert page.evaluate("localStorage.length") == 0
        page.screenshot(path=str(artifacts / "console-tenant.png"), full_page=True)

        page.click("[data-action=sign-out]")
        page.wait_for_selector("form[data-form=sign-in]")
        assert page.evaluate("sessionStorage.length") == 0
        assert not [line for line in seen if key in line or line.startswith("pageerror")], seen
    finally:
        context.close()


def test_console_is_served_self_contained(server: Server) -> None:
    """No CDN, no external request: every URL in the console's files is this origin's (the SVG
    namespace is a name, not a fetch), and the CSP forbids anything else."""
    page = httpx.get(f"{server.base_url}/console/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    static = Path(__file__).parents[2] / "web" / "static"
    for file in static.iterdir():
        text = file.read_text().replace("http://www.w3.org/2000/svg", "")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, file.name
        assert httpx.get(f"{server.base_url}/console/{file.name}").status_code == 200


def test_a_tenant_whose_key_is_revoked_is_signed_out(
    browser: Any, server: Server, tenant: dict[str, Any]
) -> None:
    key = admin_post(server, f"/admin/tenants/{tenant['tenant']['id']}/keys", {"name": "short-lived"})
    context, page, _ = open_console(browser, server)
    try:
        sign_in(page, key["key"])
        page.wait_for_selector("svg[data-chart=requests-per-day]")
        # The replica that revokes forgets the key at once: no wait on the auth cache's TTL.
        assert httpx.delete(f"{server.base_url}/admin/keys/{key['id']}", headers=ADMIN).status_code == 200
        page.click("[data-action=refresh]")
        page.wait_for_selector("[data-state=sign-in-error]:has-text('revoked')")
        assert page.evaluate("sessionStorage.length") == 0
    finally:
        context.close()


def test_a_wrong_key_is_refused_at_sign_in(browser: Any, server: Server) -> None:
    context, page, _ = open_console(browser, server)
    try:
        sign_in(page, "sk-sluice-not-a-real-key")
        page.wait_for_selector("[data-state=sign-in-error]:has-text('Key refused')")
        assert page.evaluate("sessionStorage.length") == 0
    finally:
        context.close()


def test_admin_manages_keys_and_sees_nodes_and_models(
    browser: Any, server: Server, tenant: dict[str, Any], artifacts: Path
) -> None:
    t, main, spare = tenant["tenant"], tenant["main"], tenant["spare"]
    assert chat(server, spare["key"]).status_code == 200  # the key works before the admin revokes it

    context, page, seen = open_console(browser, server)
    try:
        sign_in(page, ADMIN_KEY)
        page.wait_for_selector(f"tr[data-tenant-id='{t['id']}']")
        assert page.text_content("[data-state=who]") == "Admin"
        page.click(f"tr[data-tenant-id='{t['id']}']")

        # The admin sees the tenant's usage with the same numbers as the tenant.
        bar = "svg[data-chart=requests-per-day] rect[data-series=requests]"
        page.wait_for_selector(f"[data-tenant-detail] {bar}[data-value='{REQUESTS + 1}']", state="attached")

        # Revoke the spare key: two clicks (arm, confirm), then the row shows it revoked.
        row = f"tr[data-key-id='{spare['id']}']"
        page.click(f"{row} [data-action=revoke]")
        page.click(f"{row} [data-action=revoke][data-armed]")
        page.wait_for_selector(f"{row}[data-revoked=true]")
        page.screenshot(path=str(artifacts / "console-admin-tenant.png"), full_page=True)

        deadline = time.monotonic() + 5  # revocation reaches the auth cache within its 1 s TTL
        while (refused := chat(server, spare["key"])).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert refused.status_code == 401, refused.text
        assert "revoked" in refused.json()["error"]["message"]
        assert chat(server, main["key"]).status_code == 200  # only that key

        # Issue a key in the UI: its secret is shown once and works against the API.
        page.fill("form[data-form=issue-key] input[name=key-name]", "from-console")
        page.click("form[data-form=issue-key] button[type=submit]")
        secret = page.text_content("[data-notice=new-key] code", timeout=120_000)
        assert secret and chat(server, secret).status_code == 200

        page.click("[data-tab=nodes]")
        nodes = httpx.get(f"{server.base_url}/admin/nodes", headers=ADMIN)
        if nodes.status_code == 200:
            report = nodes.json()
            page.wait_for_selector("[data-view=nodes]")
            for node in report["nodes"]:
                status = page.get_attribute(f"tr[data-node-id='{node['id']}']", "data-status")
                assert status == node["status"]
        else:
            page.wait_for_selector("[data-state=nodes-unavailable]")
        page.screenshot(path=str(artifacts / "console-admin-nodes.png"), full_page=True)

        page.click("[data-tab=models]")
        models = httpx.get(f"{server.base_url}/admin/models", headers=ADMIN).json()["data"]
        for m in models:
            page.wait_for_selector(f"tr[data-model='{m['id']}']")
        page.screenshot(path=str(artifacts / "console-admin-models.png"), full_page=True)

        keys = (ADMIN_KEY, main["key"], spare["key"], secret)
        assert not [line for line in seen if any(k in line for k in keys) or line.startswith("pageerror")]
    finally:
        context.close()


NODES = {
    "nodes": [
        {
            "id": "node-0",
            "status": "healthy",
            "running": 4,
            "waiting": 0,
            "kv_blocks_used": 120,
            "kv_blocks_total": 512,
            "tokens_per_s": 210.5,
            "itl_p50_ms": 21.0,
            "itl_p99_ms": 35.2,
            "ttft_p50_ms": 80.0,
            "reason": None,
            "since": None,
        },
        {
            "id": "node-1",
            "status": "sluggish",
            "running": 4,
            "waiting": 2,
            "kv_blocks_used": 480,
            "kv_blocks_total": 512,
            "tokens_per_s": 61.0,
            "itl_p50_ms": 74.9,
            "itl_p99_ms": 140.0,
            "ttft_p50_ms": 260.0,
            "reason": "ITL 3.4x peers at batch 4",
            "since": 1_790_000_000.0,
        },
        {
            "id": "node-2",
            "status": "stalled",
            "running": 3,
            "waiting": 5,
            "kv_blocks_used": 300,
            "kv_blocks_total": 512,
            "tokens_per_s": 0.0,
            "itl_p50_ms": None,
            "itl_p99_ms": None,
            "ttft_p50_ms": None,
            "reason": "no token for 12 s with 3 running",
            "since": 1_790_000_100.0,
        },
    ],
    "events": [
        {"time": 1_790_000_000.0, "node": "node-1", "kind": "flagged", "reason": "ITL 3.4x peers at batch 4"},
        {"time": 1_790_000_100.0, "node": "node-2", "kind": "stalled", "reason": "no token for 12 s"},
    ],
}


def test_nodes_show_their_status_and_an_outage_shows_as_unavailable(
    browser: Any, server: Server, artifacts: Path
) -> None:
    """The console's reading of every node status, with /admin/nodes answered by the test (a synthetic
    server has one node, always healthy); then the endpoint failing."""
    context, page, _ = open_console(browser, server)
    failing = {"on": False}

    def nodes(route: Any) -> None:
        if failing["on"]:
            route.fulfill(status=503, json={"error": {"message": "driver unavailable"}})
        else:
            route.fulfill(status=200, json=NODES)

    try:
        page.route("**/admin/nodes", nodes)
        sign_in(page, ADMIN_KEY)
        page.click("[data-tab=nodes]")
        page.wait_for_selector("[data-view=nodes]")
        for node in NODES["nodes"]:
            assert page.get_attribute(f"tr[data-node-id='{node['id']}']", "data-status") == node["status"]
        assert value(page, "[data-metric=nodes_sluggish]") == 1
        assert value(page, "[data-metric=nodes_stalled]") == 1
        assert (
            value(page, "svg[data-chart=node-itl] rect[data-category=node-1][data-series=itl_p50_ms]") == 74.9
        )
        assert "ITL 3.4x peers" in page.text_content("tr[data-node-id=node-1]")
        assert page.locator("[data-table=node-events] tbody tr").count() == 2
        page.screenshot(path=str(artifacts / "console-admin-nodes-sluggish.png"), full_page=True)

        failing["on"] = True  # the next 5 s refresh finds the endpoint down
        page.wait_for_selector("[data-state=nodes-unavailable]", timeout=120_000)
        assert "driver unavailable" in page.text_content("[data-state=nodes-unavailable]")
        assert page.locator("[data-tab=tenants]").is_visible()  # the rest of the console still works
    finally:
        context.close()


def test_a_tab_clicked_while_the_first_one_loads_is_the_one_shown(browser: Any, server: Server) -> None:
    """The admin view opens on the tenants tab; a click on Nodes before the tenants have loaded shows the nodes,
    and the tenants' answer, arriving after, does not paint over them."""
    context, page, _ = open_console(browser, server)
    held: list[Any] = []
    try:
        calls = {"n": 0}

        def tenants(route: Any) -> None:  # the sign-in's own request passes; the tab's is answered when the test says
            calls["n"] += 1
            if calls["n"] == 1:
                route.continue_()
            else:
                held.append(route)

        page.route("**/admin/tenants", tenants)
        page.route("**/admin/nodes", lambda route: route.fulfill(status=200, json=NODES))
        sign_in(page, ADMIN_KEY)
        page.wait_for_selector("[data-tab=nodes]")
        deadline = time.monotonic() + 120
        while not held and time.monotonic() < deadline:
            page.wait_for_timeout(50)
        assert held, "the tenants tab never asked for /admin/tenants"
        page.click("[data-tab=nodes]")
        page.wait_for_selector("[data-view=nodes]")
        held[0].continue_()  # the tenants' answer, now late
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(500)
        assert page.is_visible("[data-view=nodes]")
        assert page.query_selector("[data-table=tenants]") is None
    finally:
        context.close()
