"""Liveness and readiness probes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import create_async_engine


async def test_healthz_needs_no_key(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert response.headers["x-request-id"]


async def test_readyz_reports_ready_once_the_backend_is(app: Any, client: httpx.AsyncClient) -> None:
    original = app.state.resources.backend
    app.state.resources.backend = SimpleNamespace(ready=True)
    try:
        response = await client.get("/readyz")
    finally:
        app.state.resources.backend = original
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "models": {app.state.resources.fleet.default.name: "ready"}}


async def test_readyz_is_503_while_the_backend_loads(app: Any, client: httpx.AsyncClient) -> None:
    original = app.state.resources.backend
    app.state.resources.backend = SimpleNamespace(ready=False)
    try:
        response = await client.get("/readyz")
    finally:
        app.state.resources.backend = original
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "service_unavailable"
    assert error["code"] == "backend_not_ready"


async def test_readyz_is_503_when_the_database_is_unreachable(app: Any, client: httpx.AsyncClient) -> None:
    original = app.state.resources.engine
    # nothing listens on port 1: refused at once (the test took 0.01 s here); a connection that
    # timed out instead would give the same 503
    unreachable = create_async_engine("postgresql+asyncpg://root@127.0.0.1:1/test", connect_args={"timeout": 2})
    app.state.resources.engine = unreachable
    try:
        response = await client.get("/readyz")
    finally:
        app.state.resources.engine = original
        await unreachable.dispose()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "database_unavailable"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
