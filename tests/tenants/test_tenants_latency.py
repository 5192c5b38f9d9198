"""Latency percentiles computed by the database: nearest rank, by day and model, completed requests
only, over the newest records when there are too many; SQLite and PostgreSQL agree with a reference."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import random
import uuid
from collections.abc import Sequence

from sqlalchemy import insert

from tenants.db import create_engine, run_migrations, session_factory
from tenants.latency import Percentiles, nearest_rank
from tenants.models import UsageRecord
from tenants.service import TenantService, TenantSpec

T0 = dt.datetime(2030, 1, 1, 23, 30, tzinfo=dt.UTC)


def reference(values: Sequence[float]) -> Percentiles | None:
    """Nearest rank by the book: sort, take the ceil(q * n / 100)-th."""
    ordered = sorted(values)
    if not ordered:
        return None
    return Percentiles(*(ordered[max(1, math.ceil(q * len(ordered) / 100)) - 1] for q in (50, 90, 99)))


def test_nearest_rank() -> None:
    assert [nearest_rank(100, q) for q in (50, 90, 99, 100)] == [50, 90, 99, 100]
    assert nearest_rank(1, 50) == 1 and nearest_rank(2, 50) == 1 and nearest_rank(2, 51) == 2


def test_the_database_computes_nearest_rank_percentiles(db_url: str) -> None:
    rng = random.Random(7)
    # (created_at, model, ttft_ms or None, latency_ms, status); 5 s apart, across midnight (UTC)
    records = [
        (T0 + dt.timedelta(seconds=5 * i), rng.choice("abc"), None if i % 7 == 0 else
         round(rng.uniform(1, 500), 3), round(rng.uniform(10, 5000), 3), "ok" if i % 11 else "disconnected")
        for i in range(1000)
    ]  # fmt: skip
    records.append((T0 - dt.timedelta(seconds=1), "only-errors", 1.0, 1.0, "EngineDeadError"))
    records.append((T0 - dt.timedelta(seconds=2), "no-ttft", None, 42.0, "ok"))

    async def main() -> None:
        engine = create_engine(db_url)
        await run_migrations(engine)
        sessions = session_factory(engine)
        try:
            service = TenantService(sessions)
            tenant = await service.create_tenant(TenantSpec(name=f"lat-{uuid.uuid4().hex[:8]}"))
            rows = [
                {"request_id": f"r{i}", "tenant_id": tenant.id, "model": m, "prompt_tokens": 1,
                 "completion_tokens": 1, "ttft_ms": f, "latency_ms": n, "status": s, "created_at": t}
                for i, (t, m, f, n, s) in enumerate(records)
            ]  # fmt: skip
            async with sessions.begin() as session:
                await session.execute(insert(UsageRecord), rows)
            ok = [r for r in records if r[4] == "ok"]
            window = (T0 - dt.timedelta(hours=1), T0 + dt.timedelta(hours=3))

            for group_by, key in (("model", lambda r: r[1]), ("day", lambda r: r[0].strftime("%Y-%m-%d"))):
                report = await service.latency(tenant.id, *window, group_by)  # type: ignore[arg-type]
                expected = sorted({key(r) for r in ok})
                assert [g.group for g in report.groups] == expected
                for g in report.groups:
                    mine = [r for r in ok if key(r) == g.group]
                    assert g.requests == len(mine)
                    assert g.latency_ms == reference([r[3] for r in mine])
                    assert g.ttft_ms == reference([r[2] for r in mine if r[2] is not None])
                assert report.overall.group == "all" and report.overall.requests == len(ok)
                assert report.overall.latency_ms == reference([r[3] for r in ok])
                assert report.overall.ttft_ms == reference([r[2] for r in ok if r[2] is not None])
                assert not report.truncated
            by_model = {g.group: g for g in (await service.latency(tenant.id, *window, "model")).groups}
            assert "only-errors" not in by_model
            assert by_model["no-ttft"].ttft_ms is None
            assert by_model["no-ttft"].latency_ms == Percentiles(42.0, 42.0, 42.0)

            # Over the cap: the newest records only, and the report says so.
            newest = sorted(ok, key=lambda r: r[0], reverse=True)[:100]
            capped = await service.latency(tenant.id, *window, "model", max_samples=100)
            assert capped.truncated and capped.overall.requests == 100
            assert capped.overall.latency_ms == reference([r[3] for r in newest])

            later = T0 + dt.timedelta(days=9)
            empty = await service.latency(tenant.id, later, later + dt.timedelta(days=1), "day")
            assert (empty.groups, empty.overall.requests, empty.overall.latency_ms) == ([], 0, None)
        finally:
            await engine.dispose()

    asyncio.run(main())
