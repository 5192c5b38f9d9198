"""The outbox side of the usage ledger: billing lines written in the usage flush's own transaction.

`UsageWriter` (tenants/usage.py) calls `BillingOutbox.add(session, batch)` inside the transaction that
inserts the batch's usage records, so a usage record and the tokens it bills commit or roll back
together: no usage is billed that was not recorded, none recorded that is not billed.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from billing.config import COMPLETION, PROMPT
from billing.models import BillingLine
from tenants.models import utcnow
from tenants.usage import UsageEvent

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def window_start(when: dt.datetime, window_s: int) -> dt.datetime:
    """The start of the window `when` falls in; windows are aligned to the Unix epoch (so to days)."""
    seconds = int((when - EPOCH).total_seconds())
    return EPOCH + dt.timedelta(seconds=seconds - seconds % window_s)


def lines_for(batch: Sequence[UsageEvent], meters: Sequence[str], window_s: int) -> list[dict[str, Any]]:
    """One line per tenant, meter and window of `batch`, summing its tokens; zero sums are left out."""
    sums: dict[tuple[str, str, dt.datetime], int] = defaultdict(int)
    for event in batch:
        window = window_start(event.created_at, window_s)
        tokens = {PROMPT: event.prompt_tokens, COMPLETION: event.completion_tokens}
        for meter in meters:
            if tokens[meter] > 0:
                sums[(event.tenant_id, meter, window)] += tokens[meter]
    now = utcnow()
    return [
        {"tenant_id": t, "meter": m, "window_start": w, "value": v, "event_id": None, "created_at": now}
        for (t, m, w), v in sums.items()
    ]


class BillingOutbox:
    """Implements `tenants.usage.UsageOutbox`."""

    def __init__(self, meters: Sequence[str], window_s: int) -> None:
        self.meters = tuple(meters)
        self.window_s = window_s

    async def add(self, session: AsyncSession, batch: Sequence[UsageEvent]) -> None:
        rows = lines_for(batch, self.meters, self.window_s)
        if rows:
            await session.execute(insert(BillingLine), rows)
