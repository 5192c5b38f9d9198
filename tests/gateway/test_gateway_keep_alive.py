"""Idle connections: the server keeps them longer than its clients' pools do (gateway/settings.py
`keep_alive_timeout_s`), so a client that reads a response late can still send its next request on the
same connection instead of into one the server is closing.

The server's keep-alive clock starts when it has written a response; a client busy with 256 streams read
one ~5 s later, reused the connection just as uvicorn's default 5 s closed it, and that request died with a
reset (1 in ~2,000 requests at 256 streams). These tests drive one connection by hand, as a pool would."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from gateway_server import Server, start_server

from benchmarks.worker_process import WorkerProcess

LATE_S = 5.5  # later than uvicorn's default keep-alive and httpx's pool expiry (5 s)


def _request(method: str, path: str, body: dict[str, object] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    return head.encode() + data


def _read_response(conn: socket.socket) -> bytes:
    """One whole response (Content-Length or chunked); b"" when the server closed the connection instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    lengths = {k.strip().lower(): v.strip() for k, v in fields.items()}
    if b"content-length" in lengths:
        while len(rest) < int(lengths[b"content-length"]):
            rest += conn.recv(65536)
    else:  # chunked: until the last, empty chunk
        while not rest.endswith(b"0\r\n\r\n"):
            rest += conn.recv(65536)
    return head


def _status(head: bytes) -> str:
    return head.split(b"\r\n")[0].decode() if head else "closed"


def _read_late_then_reuse(address: tuple[str, int], first: bytes, second: bytes, late_s: float) -> str:
    """Send `first`, read its response `late_s` later, send `second` on the same connection: its status line."""
    with socket.create_connection(address, timeout=10) as conn:
        conn.sendall(first)
        time.sleep(late_s)  # the whole response waits, unread, in the socket buffer
        assert _status(_read_response(conn)) == "HTTP/1.1 200 OK"
        try:
            conn.sendall(second)
            return _status(_read_response(conn))
        except OSError:  # a reset
            return "closed"


STREAM = _request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True})


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.fixture(scope="module")
def default_server() -> Iterator[Server]:
    yield from start_server("--synthetic-tokens-per-second", "200", "--synthetic-ttft-ms", "5")


@pytest.fixture(scope="module")
def short_keep_alive_server() -> Iterator[Server]:
    yield from start_server("--synthetic-tokens-per-second", "200", "--synthetic-ttft-ms", "5",
                            "--keep-alive-timeout", "1")


def test_a_stream_read_late_leaves_its_connection_open_for_the_next_request(default_server: Server) -> None:
    assert _read_late_then_reuse(_address(default_server.base_url), STREAM, STREAM, LATE_S) == "HTTP/1.1 200 OK"


def test_keep_alive_timeout_is_the_servers_idle_limit(short_keep_alive_server: Server) -> None:
    assert _read_late_then_reuse(_address(short_keep_alive_server.base_url), STREAM, STREAM, 2.0) == "closed"


def test_a_worker_keeps_a_gateways_idle_connection_past_its_pool_expiry() -> None:
    worker = WorkerProcess("keepalive", ["--driver", "synthetic"])
    try:
        readyz = _request("GET", "/readyz")
        assert _read_late_then_reuse(_address(worker.url), readyz, readyz, LATE_S) == "HTTP/1.1 200 OK"
    finally:
        worker.stop()
