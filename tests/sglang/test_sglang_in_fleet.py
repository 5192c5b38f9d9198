"""SGLang servers as a node kind of the fleet: one `sluice serve --driver fleet` over a `sluice worker`
(synthetic model) and an SGLang stand-in (its own model), through HTTP. Each model is served by the
nodes that have it, both kinds show in /admin/nodes with their counts, and when the SGLang server
goes down its model is a 503 with Retry-After while the worker's model is still served."""

from __future__ import annotations

import httpx
import pytest
from standin_process import standins

from benchmarks.server_process import ServerProcess
from benchmarks.worker_process import worker_processes
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(180)


def complete(base: str, model: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"model": model, "prompt": "one two three four", "max_tokens": 4},
                      timeout=30)


def test_one_fleet_serves_a_worker_and_an_sglang_server_side_by_side() -> None:
    with standins(1, "--token-delay-ms", "5") as servers, worker_processes(1, "--driver", "synthetic") as workers, \
            ServerProcess(["--driver", "fleet", "--workers", workers[0].url, "--sglang-servers", servers[0].url],
                          startup_timeout_s=60, auth=False) as gateway:
        base = gateway.base_url
        wait_until(lambda: {m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]}
                   == {"synthetic", "standin"}, "both kinds' models listed")
        for model in ("synthetic", "standin", "synthetic", "standin"):
            r = complete(base, model)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        nodes = {n["id"]: n for n in httpx.get(base + "/admin/nodes", timeout=10).json()["nodes"]}
        assert nodes[workers[0].worker_id]["requests"] == 2 and nodes[servers[0].id]["requests"] == 2
        assert complete(base, "nope").status_code == 404

        httpx.post(servers[0].url + "/standin/health", json={"ok": False})
        wait_until(lambda: complete(base, "standin").status_code == 503, "503 once the SGLang server is down")
        down = complete(base, "standin")
        assert down.headers.get("retry-after") and down.json()["error"]["type"]
        assert complete(base, "synthetic").status_code == 200  # the worker's model is unaffected
