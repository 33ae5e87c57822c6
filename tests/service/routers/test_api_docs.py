"""/docs and /redoc work offline (every asset from the gateway itself), can be switched off, and the
OpenAPI schema documents the error envelope of every route (Anthropic's on its Messages API)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.errors import ANTHROPIC_PATHS

ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|(?:url|specUrl)\s*:\s*["']([^"']+)["']""")


def _assets(html: str) -> list[str]:
    return [a or b for a, b in ASSET.findall(html)]


@pytest.mark.parametrize(("page", "script"), [("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")])
async def test_docs_pages_load_nothing_from_elsewhere(client: httpx.AsyncClient, page: str, script: str) -> None:
    response = await client.get(page)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "http://" not in html and "https://" not in html, "a page must not reference another host"
    assets = _assets(html)
    assert any(a.endswith(script) for a in assets), assets
    for asset in assets:
        if asset.startswith("/docs/assets/"):
            fetched = await client.get(asset)
            assert fetched.status_code == 200, asset
            assert len(fetched.content) > 1000, asset
    assert "/openapi.json" in html


async def test_swagger_bundle_reads_openapi_31(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert schema["openapi"].startswith("3.1")
    # Anthropic's routes answer a body that does not match with 400, never 422; the others keep 422
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert "422" not in schema["paths"][path]["post"]["responses"], path
    assert "422" in schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    bundle = (await client.get("/docs/assets/swagger-ui-bundle.js")).text
    assert "isOAS31" in bundle  # Swagger UI 5: version 4 shows "unsupported version" for 3.1 schemas


async def test_docs_can_be_switched_off(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"api_docs": False}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui-bundle.js"):
            assert (await http.get(path)).status_code == 404, path


def test_every_operation_documents_its_errors(app: Any) -> None:
    schema = app.openapi()
    openai_ref = "#/components/schemas/ErrorEnvelope"
    operations = [
        (path, method, operation)
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]
    assert len(operations) >= 10
    for path, method, operation in operations:
        # the routes of Anthropic's Messages API answer in Anthropic's envelope
        envelope_ref = "#/components/schemas/AnthropicErrorEnvelope" if path in ANTHROPIC_PATHS else openai_ref
        errors = {code: body for code, body in operation["responses"].items() if code[0] in "45"}
        assert "503" in errors, f"{method.upper()} {path} does not document 503"
        for code, body in errors.items():
            if code == "422" and "application/json" in body.get("content", {}):
                ref = body["content"]["application/json"]["schema"].get("$ref", "")
                assert ref in {envelope_ref, "#/components/schemas/HTTPValidationError"}, (path, code)
                continue
            ref = body["content"]["application/json"]["schema"]["$ref"]
            assert ref == envelope_ref, f"{method.upper()} {path} {code}: {ref}"
        if path.startswith(("/v1/", "/admin", "/trace")):
            for code in ("400", "401", "403", "429", "500"):
                assert code in errors, f"{method.upper()} {path} does not document {code}"
