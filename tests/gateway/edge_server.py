"""A real `sluice serve --driver synthetic` with auth on (SQLite), a tenant and its key, for the tests
of the HTTP edge: bounds, body deadline, /metrics access and the OpenAPI schema (and its fuzz run)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from gateway_server import Server, start_server

ADMIN_KEY = "edge-test-admin-key"
METRICS_TOKEN = "edge-test-metrics-token"
BODY_TIMEOUT_S = 2.0
HANG_S = 60.0  # only catches a hang: nothing here should take longer than the body timeout


@dataclass(frozen=True)
class EdgeServer:
    server: Server
    tenant_id: str
    tenant_name: str
    tenant_key: str

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def tenant_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tenant_key}"}


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_KEY}"}


def start_edge_server(data_dir: Path, *options: str, **env: str) -> Iterator[EdgeServer]:
    environment = {
        "SLUICE_ADMIN_KEY": ADMIN_KEY,
        "SLUICE_METRICS_TOKEN": METRICS_TOKEN,
        "SLUICE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "SLUICE_DATA_DIR": str(data_dir),
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "SLUICE_USAGE_FLUSH_MS": "50",
        **env,
    }
    fast = ("--synthetic-tokens-per-second", "0", "--synthetic-ttft-ms", "1", "--max-model-len", "256")
    for server in start_server(*fast, *options, auth=True, env=environment):
        name = f"edge-{uuid.uuid4().hex[:8]}"
        tenant = httpx.post(f"{server.base_url}/admin/tenants", json={"name": name}, headers=admin_headers())
        assert tenant.status_code == 201, tenant.text
        tenant_id = tenant.json()["id"]
        key = httpx.post(
            f"{server.base_url}/admin/tenants/{tenant_id}/keys", json={"name": "edge"}, headers=admin_headers()
        )
        assert key.status_code == 201, key.text
        yield EdgeServer(server, tenant_id, name, key.json()["key"])
