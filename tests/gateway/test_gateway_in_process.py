"""App behaviour that needs special settings, in-process through Litestar's test client."""

from __future__ import annotations

import asyncio
import json

from litestar.testing import TestClient

from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.settings import Settings


def test_lifetime_cap_cuts_streams_and_whole_responses() -> None:
    driver = SyntheticDriver(tokens_per_second=20, ttft_s=0)
    app = create_app(Settings(stream_timeout_s=0.3, auth=False), driver)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert resp.status_code == 200
        events = [e for e in resp.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["type"] == "timeout_error"
        whole = client.post("/v1/chat/completions", json=body)
        assert whole.status_code == 504 and whole.json()["error"]["type"] == "timeout_error"
        assert client.get("/v1/engine/stats").json()["running"] == 0


def test_readyz_is_503_when_the_driver_is_not_ready() -> None:
    driver = SyntheticDriver()
    with TestClient(create_app(Settings(auth=False), driver)) as client:
        assert client.get("/readyz").status_code == 200
        asyncio.run(driver.stop())  # no requests in flight: only flips the ready flag
        resp = client.get("/readyz")
        assert resp.status_code == 503 and resp.json()["ready"] is False
        assert client.get("/healthz").status_code == 200
        error = client.post("/v1/completions", json={"prompt": "x"})
        assert error.status_code == 503 and error.headers["retry-after"] == "1"


def test_settings_from_env() -> None:
    s = Settings.from_env(
        {
            "SLUICE_PORT": "9000",
            "SLUICE_DRIVER": "synthetic",
            "SLUICE_ADMIN_KEY": "secret",
            "SLUICE_MAX_BODY_BYTES": "10",
        }
    )
    assert (s.port, s.driver, s.max_body_bytes, s.host) == (9000, "synthetic", 10, "127.0.0.1")
    assert "secret" not in repr(s)
