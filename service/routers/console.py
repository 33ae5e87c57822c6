"""/console: the forensic console, a static page and its ES modules (no build step, no CDN).

The page holds no data of its own: it calls the API with the key its user pastes, so it is served
without authentication. Every response forbids anything but the gateway's own scripts, styles and
API (a Content-Security-Policy without inline code) and is never framed; text from the API is put
into the page as text only (see service/console/trace.js).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from service.errors import NotFoundError

CONSOLE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# the page and its modules change with the gateway: revalidate, never serve a stale module
_HEADERS = {
    "Content-Security-Policy": CONSOLE_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@cache
def _assets() -> dict[str, tuple[bytes, str]]:
    """The console's files by name (read once): only these names are ever served, so no path
    from a request reaches the file system."""
    folder = resources.files("service") / "console"
    assets = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _MEDIA_TYPES:
            assets[entry.name] = (entry.read_bytes(), _MEDIA_TYPES[suffix])
    return assets


def _serve(name: str) -> Response:
    asset = _assets().get(name)
    if asset is None:
        raise NotFoundError("no such console file")
    body, media_type = asset
    return Response(content=body, media_type=media_type, headers=_HEADERS)


@router.get("/console")
@router.get("/console/")
async def console_page() -> Response:
    return _serve("index.html")


@router.get("/console/static/{name}")
async def console_asset(name: str) -> Response:
    if name == "index.html":  # the page has one address
        raise NotFoundError("no such console file")
    return _serve(name)
