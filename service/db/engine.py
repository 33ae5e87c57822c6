"""Database engine, session factory and the units of work (the only places that commit).

``session_scope`` is the unit of work of requests, the lifespan and the CLI;
``execute_committed`` is a one-statement unit of work.

Every database operation of a request is bounded (``Settings.database_timeout_s``): connecting,
waiting for a pooled connection, and each statement. A database that is down, hung or saturated
therefore surfaces within about that long as one of the errors :func:`is_database_fault`
recognises, which the API answers with 503 ``database_unavailable`` (``service.errors``).

On SQLite the writes of the process take turns first (``service.db.write_gate``): waiting for one's
turn has a bound of its own (``Settings.sqlite_write_queue_timeout_s``), and only the wait for the
file lock held by another process is bounded by ``database_timeout_s``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import ExceptionContext, Row, make_url
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.sql import Executable
from sqlalchemy.util import await_

from service.config import Settings
from service.db.write_gate import OUTAGE_MESSAGES, WriteGate, install_write_gate

# Pooled connections idle for longer than this are pinged before use (see install_liveness_check).
PING_IF_IDLE_S = 10.0
# The bound of every operation of the engines of the CLI, migrations and `xmark serve --workers N`'s
# start-up: their statements may run far longer than a request's (a backfill of message IDs for
# many users), and nobody waits on them the way a client does.
MAINTENANCE_TIMEOUT_S = 300.0

# SQLSTATE classes that mean the database, not the statement, failed: connection exception (08),
# insufficient resources (53: too many connections, out of memory or disk) and operator
# intervention (57: statement timeout or cancel, shutdown, "the database system is starting up").
_FAULT_SQLSTATE_CLASSES = frozenset({"08", "53", "57"})
# SQLite errors that mean "not now" rather than "wrong": another process holds the lock past the busy
# timeout, or the file cannot be reached, written or grown.
_SQLITE_FAULTS = OUTAGE_MESSAGES
_SQLITE_SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}


def _sqlite_pragmas(busy_timeout_ms: int, synchronous: str = "full") -> Any:
    """Every new SQLite connection: foreign keys on, the WAL journal (readers never wait for the
    writer), the busy timeout (how long a write waits for another process's lock) and the
    synchronous setting (``Settings.sqlite_synchronous``)."""
    level = _SQLITE_SYNCHRONOUS[synchronous]

    def apply(dbapi_connection: Any, _: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute(f"PRAGMA synchronous={level}")
        cursor.close()

    return apply


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return (status.st_dev, status.st_ino)


def install_sqlite_file_check(engine: AsyncEngine, path: Path) -> None:
    """A SQLite file removed or replaced under a running gateway is an outage, not a fresh start.

    Connections opened before keep writing into the removed file, where nothing will ever read
    the rows, and a new connection would create an empty file. So each checkout compares the
    file with the one the connection opened (one ``stat``; a connection to another file is
    replaced), and once a connection has opened the file, a new one is refused while it is
    missing: ``unable to open database file``, a database fault (503).
    """
    opened = False

    @event.listens_for(engine.sync_engine, "do_connect")
    def _connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
        if opened and _file_identity(path) is None:
            raise dialect.loaded_dbapi.OperationalError("unable to open database file: it was removed")
        return None  # connect as usual

    @event.listens_for(engine.sync_engine, "connect")
    def _connected(dbapi_connection: Any, record: Any) -> None:
        nonlocal opened
        record.info["sqlite_file"] = _file_identity(path)
        opened = True

    @event.listens_for(engine.sync_engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if _file_identity(path) != record.info.get("sqlite_file"):
            raise DisconnectionError("the database file was removed or replaced")


def ensure_sqlite_dir(database_url: str) -> None:
    """Create the folder of a file-backed SQLite database."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def create_engine(settings: Settings, *, timeout_s: float | None = None) -> AsyncEngine:
    """An async engine for ``settings.database_url`` (asyncpg or aiosqlite).

    Getting a connection (waiting for a pooled one, then connecting if the pool may grow) and
    every statement each give up after ``timeout_s`` (default ``settings.database_timeout_s``, the
    bound of requests; the CLI passes :data:`MAINTENANCE_TIMEOUT_S`): the wait and the connect
    get half of it each, as a request may wait out the one and then do the other. On SQLite the
    bound is the busy timeout, the wait for another process's lock; the writes of this process
    take turns in the engine's write queue first (``service.db.write_gate``), whose wait is
    bounded by ``settings.sqlite_write_queue_timeout_s``, as is the wait for a pooled connection.
    """
    timeout = settings.database_timeout_s if timeout_s is None else timeout_s
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite":
        ensure_sqlite_dir(settings.database_url)
        queue_timeout = settings.sqlite_write_queue_timeout_s
        in_memory = url.database in (None, "", ":memory:")  # one static connection, no pool to wait for
        engine = create_async_engine(
            url, connect_args={"timeout": timeout}, **({} if in_memory else {"pool_timeout": queue_timeout})
        )
        busy_timeout_ms = max(1, round(timeout * 1000))
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas(busy_timeout_ms, settings.sqlite_synchronous))
        install_write_gate(engine, WriteGate(queue_timeout_s=queue_timeout, refusal_window_s=timeout))
        if not in_memory:
            install_sqlite_file_check(engine, Path(str(url.database)).expanduser())
        return engine
    # LIFO: a checkout takes the connection used last, so a trickle of work keeps reusing one warm
    # connection instead of cycling through the pool and pinging each one idle past PING_IF_IDLE_S
    pool = {
        "pool_size": settings.database_pool_size,
        "max_overflow": 10,
        "pool_timeout": timeout / 2,
        "pool_use_lifo": True,
    }
    if url.get_driver_name() != "asyncpg":  # the generic check: a round trip on every checkout
        return create_async_engine(url, pool_pre_ping=True, **pool)
    engine = create_async_engine(
        url,
        # asyncpg: ``timeout`` bounds connecting (TCP and start-up), ``command_timeout`` every
        # statement, BEGIN and COMMIT included; a statement past it is cancelled on the server
        connect_args={"timeout": timeout / 2, "command_timeout": timeout},
        **pool,
    )
    install_liveness_check(engine, timeout_s=timeout)
    install_fault_handling(engine)
    return engine


def install_liveness_check(
    engine: AsyncEngine, ping_if_idle_s: float = PING_IF_IDLE_S, *, timeout_s: float | None = None
) -> None:
    """Refuse dead pooled connections at checkout, mostly without a round trip (asyncpg only).

    SQLAlchemy's ``pool_pre_ping`` costs three round trips on this driver (BEGIN, ping,
    ROLLBACK) on every checkout. Instead: a connection the server closed (restart, terminated
    backend, idle timeout) is known to asyncpg as soon as the event loop saw the close, so it is
    replaced for free; a connection idle for longer than ``ping_if_idle_s`` (long enough for a
    silent network drop) is pinged once (one round trip). A connection that fails either check is
    discarded and the pool hands out another. A ping that gets no answer within ``timeout_s``
    fails the checkout instead: the server is hung or saturated, and a new connection would only
    wait as long again.
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
                await_(driver.fetchrow(";", timeout=timeout_s))
            except TimeoutError as exc:
                driver.terminate()  # closed now: nothing waits for the hung ping to be cancelled
                raise OperationalError(None, None, exc, connection_invalidated=True) from None
            except Exception as exc:
                raise DisconnectionError("the database connection does not answer") from exc


def install_fault_handling(engine: AsyncEngine) -> None:
    """Make a database that does not answer fail fast and uniformly (asyncpg).

    * A connection attempt that is refused or times out raises the driver's ``OperationalError``
      (SQLAlchemy's ``OperationalError`` to the caller) rather than a bare ``OSError`` or
      ``TimeoutError``.
    * A statement that timed out raises ``OperationalError`` with ``connection_invalidated``, and
      its connection is closed at once: rolling it back would first wait for the server to
      acknowledge the cancel, as long again on a hung server. The rest of the pool is kept; a
      healthy server answers on them as soon as it is back.
    """

    @event.listens_for(engine.sync_engine, "do_connect")
    def _connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
        try:
            return dialect.connect(*cargs, **cparams)
        except (OSError, TimeoutError) as exc:
            message = f"cannot connect to the database ({type(exc).__name__})"
            raise dialect.loaded_dbapi.OperationalError(message, exc) from exc

    @event.listens_for(engine.sync_engine, "handle_error")
    def _timed_out(context: ExceptionContext) -> BaseException | None:
        if not isinstance(context.original_exception, TimeoutError):
            return None
        connection = context.connection
        if connection is not None and not connection.invalidated:
            with contextlib.suppress(Exception):  # already gone
                connection.connection.driver_connection.terminate()  # type: ignore[union-attr]
        context.is_disconnect = True
        context.invalidate_pool_on_disconnect = False
        return OperationalError(
            context.statement, None, context.original_exception, hide_parameters=True, connection_invalidated=True
        )


def _sqlstate(error: BaseException | None) -> str | None:
    """The SQLSTATE of a driver error, through SQLAlchemy's and the adapter's wrappers."""
    seen = 0
    while error is not None and seen < 4:
        code = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if isinstance(code, str):
            return code
        error = getattr(error, "orig", None) or error.__cause__
        seen += 1
    return None


def _is_fault(exc: BaseException) -> bool:
    if isinstance(exc, PoolTimeoutError):  # no pooled connection within pool_timeout
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    sqlstate = _sqlstate(exc.orig)
    if sqlstate is not None:
        return sqlstate[:2] in _FAULT_SQLSTATE_CLASSES
    if isinstance(exc, OperationalError) and type(exc.orig).__module__.startswith(("sqlite3", "aiosqlite")):
        return any(marker in str(exc.orig).lower() for marker in _SQLITE_FAULTS)  # not "no such table"
    return isinstance(exc, (OperationalError, InterfaceError))


def is_database_fault(exc: BaseException) -> bool:
    """Whether ``exc`` means the database could not be reached or did not answer in time.

    True for a pool checkout timeout, a statement or connect timeout or refusal, a connection that
    broke (``connection_invalidated``), SQLSTATE classes 08, 53 and 57 (connection lost, too many
    connections, statement cancelled, shutting down or starting up) and, on SQLite, a lock held
    past the busy timeout. Also for a SQLAlchemy error raised because of one of those (a session
    used after its connection broke). False for everything a correct program can cause by its
    own statements (constraint violations, syntax, a missing table), which stay bugs (500).
    """
    seen = 0
    error: BaseException | None = exc
    while isinstance(error, SQLAlchemyError) and seen < 4:
        if _is_fault(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


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
    instead of BEGIN, statement and COMMIT. On SQLite it is a transaction of its own instead: the
    driver runs a statement with many rows as one statement per row, which in autocommit mode
    would commit (and sync) each row alone. When the sessionmaker is bound to a connection that
    an outer transaction owns, the write joins that transaction through a session like any other
    unit of work, and becomes durable with it.
    """
    bind = sessionmaker.kw.get("bind")
    if isinstance(bind, AsyncEngine) and bind.dialect.name == "sqlite":
        async with bind.begin() as connection:
            await connection.execute(statement, parameters)
        return
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


async def read_rows(
    sessionmaker: async_sessionmaker[AsyncSession],
    statement: Executable,
    parameters: Mapping[str, Any] | None = None,
) -> Sequence[Row[Any]]:
    """The rows of one read statement, run on its own.

    Normally (``sessionmaker`` bound to the engine) on a pooled connection without a transaction
    (PostgreSQL: autocommit; one statement sees one snapshot by itself), so the read costs a single
    round trip instead of BEGIN, statement and COMMIT; SQLite reads outside a transaction as it is.
    Bound to a connection that an outer transaction owns, the read joins that transaction through
    a session like any other unit of work.
    """
    bind = sessionmaker.kw.get("bind")
    if isinstance(bind, AsyncEngine):
        async with bind.connect() as connection:
            if bind.dialect.name == "postgresql":
                connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
            return (await connection.execute(statement, parameters)).all()
    async with session_scope(sessionmaker) as session:
        return (await session.execute(statement, parameters)).all()
