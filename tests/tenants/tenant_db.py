"""Where the tenant tests find PostgreSQL: the real server at 127.0.0.1:5432, one fresh database each.

Override the server with SLUICE_TEST_PG_URL (any database on it; only host and user are used).
"""

from __future__ import annotations

import os
import uuid

PG_SERVER = os.environ.get("SLUICE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def fresh_pg_url() -> str:
    base = PG_SERVER.rsplit("/", 1)[0]
    return f"{base}/sluice_test_{uuid.uuid4().hex[:12]}"
