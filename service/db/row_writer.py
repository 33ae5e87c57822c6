"""RowWriter: commits generation and trace records, on PostgreSQL over a connection of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
from sqlalchemy import Table, insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.sql.dml import Insert

from service.db.engine import execute_committed

_Batch = list[tuple[Sequence[Mapping[str, Any]], asyncio.Future[None]]]


def _fail(batch: _Batch, exc: BaseException, *, skip: asyncio.Future[None]) -> None:
    """Fail the futures of ``batch`` still waiting (but ``skip``, whose caller raises ``exc`` itself)."""
    failure = exc if isinstance(exc, Exception) else ConnectionError("write interrupted")
    for _, future in batch:
        if future is not skip and not future.done():
            future.set_exception(failure)


def refused(exc: BaseException) -> bool:
    """Whether the database refused the rows themselves (a constraint, a bad value): writing them
    again cannot succeed, unlike after a timeout or a lost connection."""
    return isinstance(exc, (asyncpg.IntegrityConstraintViolationError, asyncpg.DataError, IntegrityError, DataError))


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

    ``conflict``: the columns of a unique key of the table. A row whose key is already stored is
    skipped (``ON CONFLICT (...) DO NOTHING``, PostgreSQL and SQLite), so a write may be repeated
    safely: a retry after a timeout whose first attempt did commit, a spooled row drained again.
    ``timeout_s`` bounds connecting and each statement.
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        table: Table,
        *,
        timeout_s: float = 10.0,
        conflict: Sequence[str] | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._table = table
        self._timeout_s = timeout_s
        self._conflict = list(conflict) if conflict is not None else None
        self._engine: AsyncEngine | None = None
        self._connection: asyncpg.Connection | None = None
        self._statements: dict[tuple[str, ...], tuple[str, list[tuple[str, Any]]]] = {}
        self._lock = asyncio.Lock()
        self._pending: _Batch = []

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
        bind = self._sessionmaker.kw["bind"]
        if not self.direct:
            # an engine, or a connection an outer transaction owns: both know their dialect
            await execute_committed(self._sessionmaker, self._insert_statement(bind.dialect), rows)
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
                except asyncpg.PostgresError:
                    if len(batch) == 1:
                        raise
                    # the server refused a row (the statement is atomic: none was stored): each
                    # caller's rows alone, so that only the refused rows' caller fails
                    await self._insert_each(bind, batch, done)
                except BaseException as exc:
                    _fail(batch, exc, skip=done)
                    raise  # this caller's own rows: ``exc`` itself
                else:
                    for _, future in batch:
                        if not future.done():  # a caller cancelled while it waited has cancelled its future
                            future.set_result(None)
        await done

    async def _insert_each(self, engine: AsyncEngine, batch: _Batch, own: asyncio.Future[None]) -> None:
        """Write each caller's rows of ``batch`` in a statement of its own; a refusal fails only
        its caller (``own``, the leader's, included: it awaits its future next)."""
        for position, (rows, future) in enumerate(batch):
            try:
                await self._insert(engine, list(rows))
            except asyncpg.PostgresError as refusal:
                if not future.done():
                    future.set_exception(refusal)
            except BaseException as exc:
                _fail(batch[position:], exc, skip=own)
                raise
            else:
                if not future.done():
                    future.set_result(None)

    def _insert_statement(self, dialect: Dialect) -> Insert:
        """INSERT into the table; with a conflict key, one that skips rows already stored."""
        if self._conflict is None:
            return insert(self._table)
        if dialect.name == "postgresql":
            return postgresql.insert(self._table).on_conflict_do_nothing(index_elements=self._conflict)
        if dialect.name == "sqlite":
            return sqlite.insert(self._table).on_conflict_do_nothing(index_elements=self._conflict)
        raise NotImplementedError(f"no idempotent INSERT for the {dialect.name} dialect")

    def _statement(self, engine: AsyncEngine, keys: tuple[str, ...]) -> tuple[str, list[tuple[str, Any]]]:
        """The INSERT for rows with ``keys`` in the server's syntax, with each column's bind
        processing (compiled once per set of keys)."""
        statement = self._statements.get(keys)
        if statement is None:
            compiled = self._insert_statement(engine.dialect).compile(
                dialect=engine.dialect, column_keys=list(keys), for_executemany=True
            )
            order = list(compiled.positiontup or ())
            missing = sorted(set(order) - set(keys))
            if missing:
                raise ValueError(f"rows for {self._table.name} lack the columns {missing}")
            # the type as this dialect stores it (a TypeDecorator may load a dialect-specific impl)
            processors = [
                (name, self._table.c[name].type.dialect_impl(engine.dialect).bind_processor(engine.dialect))
                for name in order
            ]
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
