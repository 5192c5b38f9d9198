"""Billing through the real app (in-process, SQLite): linking a tenant in the admin API, usage of real
requests landing in the outbox, the gateway's own relay sending to the stand-in, the console's views."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from harness import config, write_usage
from litestar.testing import TestClient
from stripe_standin import RunningStandIn

from drivers.synthetic import SyntheticDriver
from gateway.app import create_app
from gateway.settings import Settings
from tenants.db import create_engine, session_factory
from tests.polling import wait_until

ADMIN = {"authorization": "Bearer test-admin-key"}
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
T = TypeVar("T")


def poll(fetch: Callable[[], T], done: Callable[[T], bool], what: str) -> T:
    last: list[T] = []

    def check() -> bool:
        last[:] = [fetch()]
        return done(last[0])

    wait_until(check, what)
    return last[0]


def totals(billed: dict[str, Any], state: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for day in billed["data"]:
        out[day["meter"]] = out.get(day["meter"], 0) + day[state]
    return out


def test_linked_tenant_is_billed_by_the_gateways_relay(tmp_path: Path, stripe_standin: RunningStandIn) -> None:
    cfg = config(stripe_standin)
    settings = Settings(data_dir=str(tmp_path), admin_key="test-admin-key", usage_flush_interval_s=0.02,
                        billing=cfg)
    driver = SyntheticDriver(tokens_per_second=0, ttft_s=0)
    with TestClient(create_app(settings, driver)) as client:
        made = client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)
        assert made.status_code == 201 and made.json()["stripe_customer_id"] is None
        tenant = made.json()["id"]
        for bad in ("acct_123", "cus_", "cus_ x", "cus_" + "a" * 300, 17):
            refused = client.patch(f"/admin/tenants/{tenant}", json={"stripe_customer_id": bad}, headers=ADMIN)
            assert refused.status_code == 400 and "stripe_customer_id" in refused.text, refused.text
        linked = client.patch(f"/admin/tenants/{tenant}", json={"stripe_customer_id": "cus_Acme42"}, headers=ADMIN)
        assert linked.status_code == 200 and linked.json()["stripe_customer_id"] == "cus_Acme42"
        key = client.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN).json()["key"]
        headers = {"authorization": f"Bearer {key}"}

        used = {"prompt": 0, "completion": 0}
        for _ in range(3):
            reply = client.post("/v1/chat/completions", json=CHAT, headers=headers).json()["usage"]
            used["prompt"] += reply["prompt_tokens"]
            used["completion"] += reply["completion_tokens"]
        # Real requests land in the outbox, in their window (unsealed until it closes, then sent).
        def recorded(b: dict[str, Any]) -> dict[str, int]:
            return {m: sum(totals(b, s).get(m, 0) for s in ("unsealed", "pending", "sent")) for m in used}

        poll(lambda: client.get("/v1/billing", headers=headers).json(),
             lambda b: recorded(b) == used, "the requests' usage in the outbox")

        # Usage of closed windows (written by the usage writer into the same database) is sealed and sent
        # by the relay this gateway runs.
        async def backfill() -> tuple[int, int]:
            engine = create_engine(f"sqlite:///{tmp_path.resolve() / 'sluice.db'}")
            try:
                return await write_usage(session_factory(engine), cfg, tenant, 20, minutes_ago=30)
            finally:
                await engine.dispose()

        prompt, completion = asyncio.run(backfill())
        state = poll(lambda: client.get("/admin/billing", headers=ADMIN).json(),
                     lambda s: s["events"]["sent"]["tokens"] >= prompt + completion, "the relay to send")
        assert state["relay_running"] and state["enabled"] and state["events"]["dead"]["events"] == 0
        def sent_and_stripe() -> tuple[dict[str, int], dict[str, int]]:
            sent = totals(client.get(f"/admin/tenants/{tenant}/billing", headers=ADMIN).json(), "sent")
            app = stripe_standin.app
            return sent, {"prompt": int(app.total("sluice_prompt_tokens", "cus_Acme42")),
                          "completion": int(app.total("sluice_completion_tokens", "cus_Acme42"))}

        # Stripe == ledger (read twice: the requests' own window may close and be sent in between).
        sent, _ = poll(sent_and_stripe, lambda x: x[0] == x[1], "Stripe to equal the ledger")
        # The backfill, plus the requests' own usage if their window closed meanwhile.
        assert sent["prompt"] - prompt in (0, used["prompt"])
        assert sent["completion"] - completion in (0, used["completion"])
        metrics = client.get("/metrics", headers=ADMIN).text
        assert "sluice_billing_events_sent_total" in metrics and "sluice_billing_lag_seconds" in metrics

        assert client.get(f"/admin/tenants/{uuid.uuid4()}/billing", headers=ADMIN).status_code == 404
        assert client.get("/v1/billing", headers=ADMIN).status_code in (401, 403)
        assert client.get("/v1/billing?start=not-a-date", headers=headers).status_code == 400
        assert client.get("/admin/billing", headers=headers).status_code in (401, 403)
