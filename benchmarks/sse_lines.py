"""Lines of a server-sent event stream as the SSE spec defines them, for the benchmark clients.

SSE ends a line at CR, LF or CR LF, and nowhere else. httpx's `aiter_lines()` splits as
`str.splitlines()` does, also at U+0085, U+2028 and U+2029, which JSON may carry raw inside a
string: a chunk whose text holds one arrived as two broken lines (a "bad event" in `sluice bench
serve`, seen at 32 streams of random token ids). Sluice escapes those three; another server may not.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    pending = b""
    async for piece in response.aiter_bytes():
        pending += piece
        *lines, pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")
