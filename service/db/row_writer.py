"""RowWriter: commits generation and trace records, on PostgreSQL over a connection of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
from sqlalchemy import Table, insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from service.db.engine import execute_committed


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
