"""API documentation pages that work offline: Swagger UI at /docs and ReDoc at /redoc.

FastAPI's own pages load their scripts and styles from a CDN, so they are blank where the gateway
has no internet. These serve the same pages from the assets of the ``fastapi-offline`` package
(Swagger UI 5, which reads OpenAPI 3.1, and ReDoc's standalone bundle), under ``/docs/assets``.
``XMARK_API_DOCS=false`` switches the pages and ``/openapi.json`` off.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request
from starlette.responses import HTMLResponse

ASSETS_PATH = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs/assets"
DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"


def install_api_docs(app: FastAPI) -> None:
    """Mount the assets and the two pages on ``app`` (whose ``openapi_url`` must be set)."""
    openapi_url = app.openapi_url
    assert openapi_url is not None, "the docs pages read the OpenAPI schema"
    router = APIRouter(include_in_schema=False)

    def _asset(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{ASSETS_URL}/{name}"

    @router.get(DOCS_URL)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=f"{request.scope.get('root_path', '')}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=OAUTH2_REDIRECT_URL,
            swagger_js_url=_asset(request, "swagger-ui-bundle.js"),
            swagger_css_url=_asset(request, "swagger-ui.css"),
            swagger_favicon_url=_asset(request, "favicon.png"),
        )

    @router.get(OAUTH2_REDIRECT_URL)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get(REDOC_URL)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(
            openapi_url=f"{request.scope.get('root_path', '')}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=_asset(request, "redoc.standalone.js"),
            redoc_favicon_url=_asset(request, "favicon.png"),
            with_google_fonts=False,
        )

    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_PATH), name="api-docs-assets")
    app.include_router(router)
