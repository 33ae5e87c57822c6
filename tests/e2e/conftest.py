"""A real gateway on a real port: uvicorn in a thread, its own migrated PostgreSQL database.

The server owns its event loop, engine and model, exactly as in production; nothing it writes
is rolled back, so it gets a database of its own that is dropped at the end of the session.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import SecretStr
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.launch import free_port
from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.config import Settings
from service.db import upgrade_database
from service.security import generate_api_key

SERVER_START_TIMEOUT = 300.0


@dataclass(frozen=True)
class LiveServer:
    base_url: str
    admin_key: str
    settings: Settings
    app: Any


@pytest.fixture(scope="session")
async def e2e_database_url(settings: Settings) -> AsyncIterator[str]:
    """A fresh database beside the test database, built by the migrations, dropped afterwards."""
    name = f"{make_url(settings.database_url).database}_e2e_{os.getpid()}"
    database_url = sibling_url(settings.database_url, name)
    await create_database(database_url, replace=True)
    try:
        await asyncio.to_thread(upgrade_database, database_url)
        yield database_url
    finally:
        await drop_database(database_url)


@pytest.fixture(scope="session")
def live_server(
    settings: Settings, e2e_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    from service.app import create_app

    admin_key = generate_api_key().plaintext
    port = free_port()
    server_settings = settings.model_copy(
        update={
            "database_url": e2e_database_url,
            "var_dir": tmp_path_factory.mktemp("e2e-var"),
            "bootstrap_admin_key": SecretStr(admin_key),
            "retain_completions": True,
            "host": "127.0.0.1",
            "port": port,
        }
    )
    app = create_app(server_settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="e2e-uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    try:
        while True:
            if not thread.is_alive():
                raise RuntimeError("the gateway exited during start-up")
            try:
                if httpx.get(f"{base_url}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready in time")
            time.sleep(0.25)
        yield LiveServer(base_url, admin_key, server_settings, app)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="session")
def e2e_engine_url(live_server: LiveServer) -> str:
    return live_server.settings.database_url


@pytest.fixture
async def e2e_db(e2e_engine_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on the live server's database, to inspect what it recorded."""
    engine = create_async_engine(e2e_engine_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()
