"""A real gateway on a real port: uvicorn in a thread, its own migrated PostgreSQL database.

The server owns its event loop, engine and model, exactly as in production; nothing it writes
is rolled back, so it gets a database of its own that is dropped at the end of the session.

Its users' message IDs (the registry every /trace scores against) are drawn from one seeded
generator instead of the product's system randomness (``seeded_message_ids``): with random IDs the
attribution p-value of an unwatermarked text was itself a random draw (named with probability up
to alpha = 1e-3 per run); seeded, the same tests register the same IDs and their outcome is fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
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
from xmark_core import Message, WatermarkParams, allocate_message

# 5x margin and more: the gateway (the SmolLM2 model loaded) was ready 41 s after the start here
SERVER_START_TIMEOUT = 300.0
MESSAGE_ID_SEED = 20240607


@contextlib.contextmanager
def seeded_message_ids(rng: random.Random) -> Iterator[None]:
    """While inside: every user the in-process gateway creates gets message IDs drawn from ``rng``
    (the product's own allocation rule, ``allocate_message``, with a seeded generator)."""
    import service.services.users

    def allocate(existing: Iterable[str], params: WatermarkParams) -> Message:
        return allocate_message(existing, params, rng=rng)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.services.users, "allocate_message", allocate)
        yield


@pytest.fixture(scope="session")
def message_id_rng() -> random.Random:
    """The one generator the live server's message IDs are drawn from, in the order of creation."""
    return random.Random(MESSAGE_ID_SEED)


@pytest.fixture(autouse=True)
def _seeded_message_ids(message_id_rng: random.Random) -> Iterator[None]:
    """Users created during a test of this package (over the live server's HTTP API) get seeded IDs."""
    with seeded_message_ids(message_id_rng):
        yield


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
    settings: Settings, e2e_database_url: str, tmp_path_factory: pytest.TempPathFactory, message_id_rng: random.Random
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
        with seeded_message_ids(message_id_rng):  # the bootstrap admin's IDs, created at start-up
            while True:
                if not thread.is_alive():
                    raise RuntimeError("the gateway exited during start-up")
                try:
                    # not a bound: a probe that times out is retried until the deadline
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
        thread.join(timeout=60)  # not a bound: teardown goes on (the thread is a daemon)


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
