"""The web console: static files under web/static, served by the gateway at /console.

No build step: plain HTML, CSS and ES modules, charts drawn as SVG by web/static/charts.js.
Everything the console shows comes from the public API with the key the user typed, which
lives in the tab's sessionStorage only. The Content-Security-Policy keeps every script, style
and request on this origin, so the console works offline and a key cannot leave it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Response, Router
from litestar.file_system import BaseLocalFileSystem
from litestar.static_files import create_static_files_router
from litestar.types.file_types import FileInfo

STATIC_DIR = Path(__file__).parent / "static"
CONSOLE_PATH = "/console"

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _secure(response: Response) -> Response:  # type: ignore[type-arg]
    response.headers.update(SECURITY_HEADERS)
    return response


class ConsoleFiles(BaseLocalFileSystem):
    """The local file system, where a path that cannot name a file is simply not found.

    A URL can carry what no file name can (`/console/%00`: a NUL byte; a name longer than the
    system allows); stat() raises ValueError or OSError for those, which Litestar would turn
    into a 500. The static router answers 404 for FileNotFoundError.
    """

    async def info(self, path: Any, **kwargs: Any) -> FileInfo:
        try:
            return await super().info(path, **kwargs)
        except (FileNotFoundError, PermissionError):
            raise
        except (ValueError, OSError) as exc:
            raise FileNotFoundError(str(path)) from exc


def console_router() -> Router:
    return create_static_files_router(
        path=CONSOLE_PATH,
        directories=[STATIC_DIR],
        file_system=ConsoleFiles(),
        html_mode=True,
        name="console",
        after_request=_secure,
    )
