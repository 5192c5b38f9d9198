"""The token-length view of latency: short and long prompts through a real server show as separate
lines, per minute, in `GET /admin/latency/by-length` and in the console's Latency tab; the admin
endpoint needs the admin key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from gateway_server import Server

ADMIN_KEY = "console-test-admin-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _tenant_key(server: Server) -> str:
    tenant = httpx.post(f"{server.base_url}/admin/tenants", json={"name": "lengths", "max_concurrent": None},
                        headers=ADMIN, timeout=30).json()
    key = httpx.post(f"{server.base_url}/admin/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=ADMIN,
                     timeout=30).json()
    return str(key["key"])


def test_short_and_long_prompts_show_as_separate_lines(server: Server, browser: Any, artifacts: Path) -> None:
    key = _tenant_key(server)
    for words in (5, 5, 300, 300):  # synthetic tokens are words: <=128 and <=512 prompt buckets
        body = {"messages": [{"role": "user", "content": " ".join(["word"] * words)}], "max_tokens": 20,
                "stream": True}
        with httpx.stream("POST", f"{server.v1}/chat/completions", json=body,
                          headers={"authorization": f"Bearer {key}"}, timeout=60) as r:
            assert r.status_code == 200
            r.read()
    assert httpx.get(f"{server.base_url}/admin/latency/by-length", timeout=30).status_code == 401
    report = httpx.get(f"{server.base_url}/admin/latency/by-length", headers=ADMIN, timeout=30).json()
    assert len(report["minutes"]) == 60
    ttft = {line["bucket"]: line["points"] for line in report["ttft_by_prompt"]}
    assert {"<=128", "<=512"} <= set(ttft)
    counts = {b: sum(p["count"] for p in points if p) for b, points in ttft.items()}
    assert counts["<=128"] >= 2 and counts["<=512"] >= 2
    positions = {line["bucket"] for line in report["itl_by_position"]}
    assert positions == {"2-16", "17-64"}  # 20 tokens: gaps before tokens 2..20

    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    try:
        page = context.new_page()
        page.goto(f"{server.base_url}/console/")
        page.fill("#key", ADMIN_KEY)
        page.click("form[data-form=sign-in] button[type=submit]")
        page.click("[data-tab=latency]")
        page.wait_for_selector("[data-view=latency]")
        for bucket in ("<=128", "<=512"):
            page.wait_for_selector(f'svg[data-chart=ttft-by-prompt] circle[data-series="{bucket}"]', state="attached")
        page.wait_for_selector('svg[data-chart=itl-by-position] circle[data-series="17-64"]', state="attached")
        page.screenshot(path=str(artifacts / "console-admin-latency.png"), full_page=True)
    finally:
        context.close()
