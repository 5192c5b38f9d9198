"""`sluice models ...` against a real server (synthetic driver, SQLite): it registers and reads the
registry, and a refused call prints the server's error and exits with 1. The synthetic driver hosts no
versions, so a deploy is refused with the reason."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_server import SLUICE, Server, start_server

ADMIN_KEY = "cli-admin-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"SLUICE_ADMIN_KEY": ADMIN_KEY, "SLUICE_DATA_DIR": str(tmp_path_factory.mktemp("cli-db"))}
    yield from start_server(auth=True, env=env)


def sluice_models(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SLUICE, "models", "--base-url", server.base_url, "--admin-key", ADMIN_KEY, "--actor", "cli-test", *args],
        check=False, capture_output=True, text=True, timeout=60,
    )


def test_the_cli_registers_reads_and_reports_refusals(server: Server, tmp_path: Path) -> None:
    registered = sluice_models(server, "register", "chat", "v1", str(tmp_path / "model.gguf"))
    assert registered.returncode == 0, registered.stderr
    assert json.loads(registered.stdout)["state"] == "registered"
    shown = json.loads(sluice_models(server, "show", "chat").stdout)
    assert [v["id"] for v in shown["versions"]] == ["chat@v1"] and shown["alias"] is None
    deploy = sluice_models(server, "deploy", "chat", "v1")
    assert deploy.returncode == 1 and json.loads(deploy.stderr)["error"]["code"] == "no_version_host"
    alias = sluice_models(server, "alias", "chat", "v1=100")
    assert alias.returncode == 1 and "registered" in json.loads(alias.stderr)["error"]["message"]
    bad = sluice_models(server, "alias", "chat", "v1")
    assert bad.returncode != 0 and "VERSION=PERCENT" in bad.stderr
    changes = json.loads(sluice_models(server, "changes", "chat").stdout)["data"]
    assert [c["action"] for c in changes] == ["register"] and changes[0]["actor"] == "cli-test"
    assert [m["name"] for m in json.loads(sluice_models(server, "list").stdout)["data"]] == ["chat"]
