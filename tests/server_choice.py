"""Whether a server process runs on gateway/server_choice.py's loop and parser."""

from __future__ import annotations

from pathlib import Path


def runs_on_uvloop_and_httptools(pid: int) -> bool:
    """Both compiled modules are mapped into the process: uvicorn imports neither unless it runs on it
    (loop="uvloop", http="httptools"); on asyncio and h11 neither is loaded."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "uvloop/loop." in maps and "httptools/parser/parser." in maps
