"""Database engine, session factory and the units of work (the only places that commit).

``session_scope`` is the unit of work of requests, the lifespan and the CLI;
``execute_committed`` is a one-statement unit of work.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.sql import Executable
from sqlalchemy.util import await_

from service.config import Settings

# Pooled connections idle for longer than this are pinged before use (see install_liveness_check).
PING_IF_IDLE_S = 10.0


def _sqlite_pragmas(dbapi_connection: Any, _: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def ensure_sqlite_dir(database_url: str) -> None:
    """Create the folder of a file-backed SQLite database."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def create_engine(settings: Settings) -> AsyncEngine:
    """An async engine for ``settings.database_url`` (asyncpg or aiosqlite)."""
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite":
        ensure_sqlite_dir(settings.database_url)
        engine = create_async_engine(url, connect_args={"timeout": 30})
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    if url.get_driver_name() != "asyncpg":  # the generic check: a round trip on every checkout
        return create_async_engine(url, pool_size=settings.database_pool_size, max_overflow=10, pool_pre_ping=True)
    engine = create_async_engine(url, pool_size=settings.database_pool_size, max_overflow=10)
    install_liveness_check(engine)
    return engine


def install_liveness_check(engine: AsyncEngine, ping_if_idle_s: float = PING_IF_IDLE_S) -> None:
    """Refuse dead pooled connections at checkout, mostly without a round trip (asyncpg only).

    SQLAlchemy's ``pool_pre_ping`` costs three round trips on this driver (BEGIN, ping,
    ROLLBACK) on every checkout. Instead: a connection the server closed (restart, terminated
    backend, idle timeout) is known to asyncpg as soon as the event loop saw the close, so it is
    replaced for free; a connection idle for longer than ``ping_if_idle_s`` (long enough for a
    silent network drop) is pinged once (one round trip). A connection that fails either check is
    discarded and the pool hands out another.
    """

    @event.listens_for(engine.sync_engine, "checkin")
    def _checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        driver = dbapi_connection.driver_connection
        if driver.is_closed():
            raise DisconnectionError("the database closed this connection")
        idle_since = record.info.get("idle_since")
        if idle_since is not None and time.monotonic() - idle_since > ping_if_idle_s:
            try:
                await_(driver.fetchrow(";"))
            except Exception as exc:
                raise DisconnectionError("the database connection does not answer") from exc


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False, autoflush=False)


@asynccontextmanager
async def session_scope(
    sessionmaker: async_sessionmaker[AsyncSession],
) -> AsyncIterator[AsyncSession]:
    """One unit of work: commit on success, roll back on any error."""
    async with sessionmaker() as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        else:
            await session.commit()


async def execute_committed(
    sessionmaker: async_sessionmaker[AsyncSession],
    statement: Executable,
    parameters: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
) -> None:
    """Run one write statement as a unit of work of its own, committed when this returns.

    Normally (``sessionmaker`` bound to the engine) the statement runs on a pooled connection in
    autocommit mode: one statement is atomic by itself, so the write costs a single round trip
    instead of BEGIN, statement and COMMIT. When the sessionmaker is bound to a connection that
    an outer transaction owns, the write joins that transaction through a session like any other
    unit of work, and becomes durable with it.
    """
    bind = sessionmaker.kw.get("bind")
    if isinstance(bind, AsyncEngine):
        async with bind.connect() as connection:
            autocommit = await connection.execution_options(isolation_level="AUTOCOMMIT")
            await autocommit.execute(statement, parameters)
        return
    async with session_scope(sessionmaker) as session:
        await session.execute(statement, parameters)


async def ping(engine: AsyncEngine) -> None:
    """Raise when the database does not answer a trivial query."""
    async with engine.connect() as connection:
        await connection.execute(text("SELECT 1"))
