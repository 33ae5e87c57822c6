"""Pooled PostgreSQL connections: dead ones are replaced at checkout, mostly without a round trip;
one-statement writes commit on their own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from service.config import Settings
from service.db import create_engine, create_sessionmaker, execute_committed, install_liveness_check


@pytest.fixture
async def engine(settings: Settings, migrated_database: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(settings.model_copy(update={"database_pool_size": 1}))
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
async def admin(settings: Settings) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(settings.database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


async def _backend_pid(engine: AsyncEngine) -> int:
    async with engine.connect() as connection:
        return int(await connection.scalar(text("SELECT pg_backend_pid()")))


async def _terminate(admin: AsyncEngine, pid: int) -> None:
    async with admin.connect() as connection:
        await connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


def _statements(engine: AsyncEngine) -> list[str]:
    seen: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda c, cur, stmt, *a: seen.append(stmt))
    return seen


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Liveness queries sent through asyncpg (they bypass SQLAlchemy's statement events)."""
    seen: list[str] = []
    original = asyncpg.connection.Connection.fetchrow

    async def fetchrow(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(query)
        return await original(self, query, *args, **kwargs)

    monkeypatch.setattr(asyncpg.connection.Connection, "fetchrow", fetchrow)
    return seen


async def test_a_healthy_pooled_connection_is_reused_without_a_ping(engine: AsyncEngine, pings: list[str]) -> None:
    pid = await _backend_pid(engine)
    statements = _statements(engine)
    assert await _backend_pid(engine) == pid
    assert statements == ["SELECT pg_backend_pid()"]
    assert pings == []


async def test_a_connection_closed_by_the_server_is_replaced(engine: AsyncEngine, admin: AsyncEngine) -> None:
    pid = await _backend_pid(engine)
    await _terminate(admin, pid)
    await asyncio.sleep(0.2)  # the pool's connection sees the server close it
    assert await _backend_pid(engine) != pid  # no error reaches the caller


async def test_a_long_idle_connection_is_pinged_and_replaced_if_dead(
    settings: Settings, migrated_database: str, pings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = create_async_engine(settings.database_url, pool_size=1)
    install_liveness_check(engine, ping_if_idle_s=0.0)
    try:
        async with engine.connect() as connection:  # a new connection: no ping
            pid = int(await connection.scalar(text("SELECT pg_backend_pid()")))
            driver = (await connection.get_raw_connection()).driver_connection
        assert pings == []
        assert await _backend_pid(engine) == pid and pings == [";"]  # idle > 0 s: pinged, alive
        # a silent network drop: the connection looks open but the ping gets no answer
        fetchrow = asyncpg.connection.Connection.fetchrow

        async def dead_fetchrow(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            if self is driver:
                raise ConnectionResetError("no answer")
            return await fetchrow(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.connection.Connection, "fetchrow", dead_fetchrow)
        assert await _backend_pid(engine) != pid  # replaced; the caller saw no error
        assert driver.is_closed()
    finally:
        await engine.dispose()


async def test_execute_committed_commits_on_its_own(engine: AsyncEngine, admin: AsyncEngine) -> None:
    table = "durable_probe_execute_committed"
    async with admin.begin() as connection:
        await connection.execute(text(f"DROP TABLE IF EXISTS {table}"))
        await connection.execute(text(f"CREATE TABLE {table} (x int)"))
    try:
        statements = _statements(engine)
        await execute_committed(
            create_sessionmaker(engine), text(f"INSERT INTO {table} (x) VALUES (:x)"), [{"x": 1}, {"x": 2}]
        )
        assert not any(s.upper().startswith(("BEGIN", "COMMIT")) for s in statements)
        async with admin.connect() as connection:
            assert await connection.scalar(text(f"SELECT count(*) FROM {table}")) == 2
    finally:
        async with admin.begin() as connection:
            await connection.execute(text(f"DROP TABLE IF EXISTS {table}"))
