"""Database engine, session factory and the units of work (the only places that commit).

``session_scope`` is the unit of work of requests, the lifespan and the CLI;
``execute_committed`` is a one-statement unit of work; ``RowWriter`` commits the rows of the
generation record, on PostgreSQL over a connection of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
from alembic import command
from alembic.config import Config
from sqlalchemy import Table, event, insert, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.sql import Executable
from sqlalchemy.util import await_

from service.config import Settings

PROJECT_ROOT = Path(__file__).resolve().parent.parent
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


class RowWriter:
    """Commits rows into one table; each ``write`` is durable when it returns.

    On PostgreSQL through asyncpg (the sessionmaker bound to the engine) the rows go over one
    connection the writer holds for itself, as a prepared INSERT in autocommit: one round trip,
    no pool checkout and no per-statement SQL compilation. Writes that arrive while one is in
    flight, or while a writer lingers (``linger_s``), are committed together by the next in one
    statement (group commit: all or none), so a busy gateway needs one round trip per batch
    rather than per request. A connection that fails or times out
    is dropped and the next write opens another; the caller decides whether to retry.

    Anywhere else (SQLite, another driver, or a sessionmaker bound to a connection whose outer
    transaction owns the writes) each write is an ``execute_committed`` unit of work.
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        table: Table,
        *,
        timeout_s: float = 10.0,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._table = table
        self._timeout_s = timeout_s
        self._engine: AsyncEngine | None = None
        self._connection: asyncpg.Connection | None = None
        self._statements: dict[tuple[str, ...], tuple[str, list[tuple[str, Any]]]] = {}
        self._lock = asyncio.Lock()
        self._pending: list[tuple[Sequence[Mapping[str, Any]], asyncio.Future[None]]] = []

    @property
    def direct(self) -> bool:
        """Whether writes go over the writer's own connection (PostgreSQL, engine-bound)."""
        bind = self._sessionmaker.kw.get("bind")
        return isinstance(bind, AsyncEngine) and bind.dialect.driver == "asyncpg"

    async def write(self, rows: Sequence[Mapping[str, Any]], *, linger_s: float = 0.0) -> None:
        """Insert ``rows`` (each with the same keys) and commit them before returning.

        ``linger_s``: the caller can wait that long before its rows are sent, so that rows arriving
        meanwhile share their statement (a write without linger takes them along at once).
        """
        if not rows:
            return
        bind = self._sessionmaker.kw.get("bind")
        if not self.direct:
            await execute_committed(self._sessionmaker, insert(self._table), rows)
            return
        assert isinstance(bind, AsyncEngine)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((rows, done))
        if linger_s > 0:
            await asyncio.sleep(linger_s)
        async with self._lock:
            if not done.done():  # no earlier batch took these rows: write every pending one
                batch, self._pending = self._pending, []
                try:
                    await self._insert(bind, [row for batch_rows, _ in batch for row in batch_rows])
                except BaseException as exc:
                    failure = exc if isinstance(exc, Exception) else ConnectionError("write interrupted")
                    for _, future in batch:
                        if future is not done:
                            future.set_exception(failure)
                    raise  # this caller's own rows: ``exc`` itself
                for _, future in batch:
                    future.set_result(None)
        await done

    def _statement(self, engine: AsyncEngine, keys: tuple[str, ...]) -> tuple[str, list[tuple[str, Any]]]:
        """The INSERT for rows with ``keys`` in the server's syntax, with each column's bind
        processing (compiled once per set of keys)."""
        statement = self._statements.get(keys)
        if statement is None:
            compiled = insert(self._table).compile(dialect=engine.dialect, column_keys=list(keys), for_executemany=True)
            order = list(compiled.positiontup or ())
            missing = sorted(set(order) - set(keys))
            if missing:
                raise ValueError(f"rows for {self._table.name} lack the columns {missing}")
            processors = [(name, self._table.c[name].type.bind_processor(engine.dialect)) for name in order]
            statement = self._statements[keys] = (str(compiled), processors)
        return statement

    async def _connect(self, engine: AsyncEngine) -> asyncpg.Connection:
        if self._connection is not None and self._engine is engine and not self._connection.is_closed():
            return self._connection
        await self._discard()
        _, options = engine.dialect.create_connect_args(engine.url)
        for sqlalchemy_only in ("prepared_statement_name_func", "async_creator_fn"):
            options.pop(sqlalchemy_only, None)
        if options.pop("prepared_statement_cache_size", None) == 0:
            # the URL switches prepared-statement caching off (e.g. behind a transaction pooler)
            options["statement_cache_size"] = 0
        self._connection = await asyncpg.connect(**options, timeout=self._timeout_s)
        self._engine = engine
        return self._connection

    async def _insert(self, engine: AsyncEngine, rows: list[Mapping[str, Any]]) -> None:
        groups: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
        for row in rows:
            groups.setdefault(tuple(row), []).append(row)
        connection = await self._connect(engine)
        for keys, group in groups.items():
            sql, processors = self._statement(engine, keys)
            arguments = [
                tuple(row[name] if process is None else process(row[name]) for name, process in processors)
                for row in group
            ]
            await self._execute(connection, sql, arguments)

    async def _execute(self, connection: asyncpg.Connection, sql: str, arguments: list[tuple[Any, ...]]) -> None:
        try:
            await connection.executemany(sql, arguments, timeout=self._timeout_s)
        except asyncpg.PostgresError:
            raise  # the server refused the rows; the connection is fine
        except BaseException:
            # timed out, cancelled or disconnected midway: the connection's state is unknown
            self._connection = None
            connection.terminate()
            raise

    async def close(self) -> None:
        """Close the writer's connection once the write in flight, if any, has finished."""
        async with self._lock:
            await self._discard()

    async def _discard(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed():
            try:
                await connection.close(timeout=self._timeout_s)
            except Exception:
                connection.terminate()


def alembic_config(database_url: str) -> Config:
    """Alembic configuration for ``database_url`` (does not touch the logging setup)."""
    config = Config(str(PROJECT_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    config.attributes["database_url"] = database_url
    config.attributes["skip_logging_config"] = True
    return config


def upgrade_database(database_url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (blocking; runs its own event loop)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade_database(database_url: str, revision: str) -> None:
    """Revert migrations down to ``revision`` ("base" removes every table)."""
    command.downgrade(alembic_config(database_url), revision)


async def ping(engine: AsyncEngine) -> None:
    """Raise when the database does not answer a trivial query."""
    async with engine.connect() as connection:
        await connection.execute(text("SELECT 1"))
