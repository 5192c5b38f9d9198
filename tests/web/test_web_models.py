"""The console's Models tab against a real `sluice serve --driver native` hosting two versions of one
model (tiny random Llamas): every version with its state, the alias's weights and generation, and the
canary beside the current version with the requests, errors and TTFT this replica measured, the same
numbers `GET /admin/models/{name}/metrics` gives."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_server import Server, start_server

from benchmarks.version_models import tiny_llama
from tests.polling import wait_until

ADMIN_KEY = "models-console-admin-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}", "x-sluice-actor": "console-test"}
MODEL = "tiny"
HANG_S = 120.0  # only catches hangs: engines load on a shared 2-core machine
REQUESTS = 20  # through the 90/10 alias: 18 on v1, 2 on v2


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Path]]]:
    folder = tmp_path_factory.mktemp("console-versions")
    sources = {"v1": tiny_llama(folder, seed=1), "v2": tiny_llama(folder, seed=2)}
    env = {"SLUICE_ADMIN_KEY": ADMIN_KEY, "SLUICE_DATA_DIR": str(tmp_path_factory.mktemp("console-models-db")),
           "DATABASE_URL": "", "REDIS_URL": ""}
    options = ("--driver", "native", "--model", str(sources["v1"]), "--dtype", "float32", "--max-model-len", "128",
               "--kv-cache-memory", str(8 * 2**20), "--num-threads", "1", "--max-num-seqs", "4")
    for server in start_server(*options, auth=True, env=env, startup_timeout_s=600):
        yield server, sources


def admin(server: Server, method: str, path: str, **body: Any) -> Any:
    resp = httpx.request(method, f"{server.base_url}{path}", headers=ADMIN, json=body or None, timeout=HANG_S)
    assert resp.status_code < 300, resp.text
    return resp.json()


def test_the_models_tab_shows_versions_alias_and_canary_figures(
    served: tuple[Server, dict[str, Path]], browser: Any, artifacts: Path
) -> None:
    server, sources = served
    for version in ("v1", "v2"):
        admin(server, "POST", f"/admin/models/{MODEL}/versions", version=version, source=str(sources[version]),
              dtype="float32")
        assert admin(server, "POST", f"/admin/models/{MODEL}/versions/{version}/deploy")["state"] == "ready"
    admin(server, "PUT", f"/admin/models/{MODEL}/alias", weights={"v1": 100}, generation=0)
    admin(server, "PUT", f"/admin/models/{MODEL}/alias", weights={"v1": 90, "v2": 10}, generation=1)
    admin(server, "POST", f"/admin/models/{MODEL}/versions", version="v3", source="/nowhere", dtype="float32")
    tenant = admin(server, "POST", "/admin/tenants", name="models-console", max_concurrent=None)
    key = admin(server, "POST", f"/admin/tenants/{tenant['id']}/keys", name="k")["key"]
    served_by: dict[str, int] = {}
    for _ in range(REQUESTS):
        resp = httpx.post(f"{server.v1}/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=HANG_S,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        served_by[resp.json()["model"]] = served_by.get(resp.json()["model"], 0) + 1
    assert served_by == {f"{MODEL}@v1": 18, f"{MODEL}@v2": 2}

    def metrics() -> dict[str, Any]:
        return {f["id"]: f for f in admin(server, "GET", f"/admin/models/{MODEL}/metrics")["versions"]}

    figures = wait_until(lambda: (m := metrics())[f"{MODEL}@v2"]["requests"] == 2 and m, "metrics recorded", HANG_S)
    assert figures[f"{MODEL}@v1"]["requests"] == 18 and figures[f"{MODEL}@v1"]["errors"] == 0
    assert figures[f"{MODEL}@v2"]["ttft_p99_ms"] is not None and figures[f"{MODEL}@v3"]["requests"] == 0
    assert httpx.get(f"{server.base_url}/admin/models/{MODEL}/metrics", timeout=HANG_S).status_code == 401

    context = browser.new_context(viewport={"width": 1400, "height": 900}, service_workers="block")
    context.set_default_timeout(HANG_S * 1000)
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.base_url}/console/")
        page.fill("#key", ADMIN_KEY)
        page.click("form[data-form=sign-in] button[type=submit]")
        page.click("[data-tab=models]")
        card = f"[data-registry-model='{MODEL}']"
        page.wait_for_selector(f"{card} table[data-table=versions]")
        assert page.get_attribute(f"{card} [data-state=generation]", "data-value") == "2"
        assert page.get_attribute(f"{card} [data-state=applied-generation]", "data-value") == "2"
        assert {w: page.get_attribute(f"{card} [data-weight={w}]", "data-value") for w in ("v1", "v2")} == {
            "v1": "90", "v2": "10",
        }
        rows = {v: f"{card} tr[data-version={v}]" for v in ("v1", "v2", "v3")}
        assert [page.get_attribute(rows[v], "data-role") for v in ("v1", "v2", "v3")] == ["current", "canary", "other"]
        assert [page.get_attribute(rows[v], "data-state") for v in ("v1", "v2", "v3")] == ["ready", "ready", "registered"]
        for version, expected in (("v1", 18), ("v2", 2)):
            count = page.get_attribute(f"{rows[version]} [data-metric=requests]", "data-value")
            assert count == str(expected)
            assert page.get_attribute(f"{rows[version]} [data-metric=errors]", "data-value") == "0"
            bar = f"{card} svg[data-chart=version-ttft] rect[data-series=ttft_p99_ms][data-category={version}]"
            shown = float(page.get_attribute(bar, "data-value") or "nan")
            assert shown == figures[f"{MODEL}@{version}"]["ttft_p99_ms"]
        page.screenshot(path=str(artifacts / "console-admin-model-versions.png"), full_page=True)
        assert not errors
    finally:
        context.close()
