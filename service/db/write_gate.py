"""One writer at a time on an embedded (SQLite) database, in the order the writes arrive.

SQLite has one write lock per database file. Left alone, the writers of a process race for it:
each waits in SQLite's busy handler, which polls with growing sleeps (no queue, no order), and a
writer that has not got the lock when the busy timeout (``XMARK_DATABASE_TIMEOUT_S``) runs out
fails as if the database were down. :func:`install_write_gate` puts a queue of the process's own
in front of the lock, for every connection of the engine (request units of work, the record
writers and the spool's drain, start-up writes, the CLI):

* A connection takes its turn at its first write (INSERT, UPDATE, DELETE, SAVEPOINT, DDL, ...;
  never at a read, so reads stay concurrent under WAL) and keeps it until it goes back to the
  pool, that is until its unit of work has committed or rolled back. With its turn it opens the
  transaction with ``BEGIN IMMEDIATE``, so the file lock is taken at the start (waiting only for
  another process, within the busy timeout) and never upgraded from a read halfway through.
* The wait for a turn has its own bound (``XMARK_SQLITE_WRITE_QUEUE_TIMEOUT_S``); past it the
  write fails with :class:`SQLiteWriteUnavailable` (503 ``database_unavailable``).
* An outage stays fast. When a writer with its turn cannot take the file lock (another process
  holds it past the busy timeout) or cannot use the file (gone, full, read-only, I/O error), the
  writers queued behind it and those arriving within the next busy timeout fail at once, instead
  of each waiting out a busy timeout of its own in turn.
* Turns are per task: a task that holds the turn on one connection and writes on another (which
  would otherwise wait for itself) writes without queueing, and SQLite's own lock decides between
  its two connections, as it did before there was a queue.

The queue is per engine, and so per process: the processes of ``xmark serve --workers N`` on one
SQLite file still meet at the file lock, within the busy timeout. PostgreSQL engines get no gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, ExceptionContext, ExecutionContext
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import await_

# SQLite errors that mean "not now" rather than "wrong": another connection holds the lock past the
# busy timeout, or the file cannot be reached, written or grown.
OUTAGE_MESSAGES = (
    "database is locked",
    "database table is locked",
    "unable to open",
    "disk i/o error",
    "database or disk is full",
    "readonly database",
)
# Statements that neither need nor take the write lock, and those that end a transaction; every
# other statement (INSERT, UPDATE, DELETE, REPLACE, SAVEPOINT, BEGIN, DDL, VACUUM, ...) writes.
# PRAGMA is left alone: some only work outside a transaction (foreign_keys, journal_mode).
_NEUTRAL = frozenset({"SELECT", "EXPLAIN", "VALUES", "PRAGMA", "COMMIT", "END", "ROLLBACK", "RELEASE"})
_FIRST_WORD = re.compile(r"[\s(]*([A-Za-z]+)")
_DML = re.compile(r"\b(INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)


class SQLiteWriteUnavailable(OperationalError, TimeoutError):
    """A write did not get its turn: the queue's bound passed, or the database has just refused its
    lock to the writer ahead. A database fault (503), and a timeout (not retried at once)."""

    def __init__(self, statement: str, message: str) -> None:
        super().__init__(statement, None, TimeoutError(message), hide_parameters=True)


def is_outage(error: BaseException) -> bool:
    """Whether a SQLite driver error means the file's lock or the file itself is out of reach."""
    message = str(error).lower()
    return any(marker in message for marker in OUTAGE_MESSAGES)


def first_word(statement: str) -> str:
    match = _FIRST_WORD.match(statement)
    return match.group(1).upper() if match else ""


def writes(statement: str, context: ExecutionContext | None) -> bool:
    """Whether ``statement`` needs SQLite's write lock."""
    word = first_word(statement)
    if word == "WITH":  # a common table expression ahead of a SELECT or of a DML statement
        if context is not None and context.compiled is not None:
            return bool(context.isinsert or context.isupdate or getattr(context, "isdelete", False))
        return _DML.search(statement) is not None
    return bool(word) and word not in _NEUTRAL


class WriteGate:
    """The turn to write on one engine's database: held by one task at a time, in arrival order.

    A holder is a pooled connection, named by its record's ``info`` dictionary (the same object
    for the record's whole life, also across an invalidation); the turn passes on once every
    connection of the holding task that wrote has gone back to the pool.
    """

    def __init__(self, *, queue_timeout_s: float, refusal_window_s: float) -> None:
        self.queue_timeout_s = queue_timeout_s
        self.refusal_window_s = refusal_window_s
        self.waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None
        self._holders: list[dict[Any, Any]] = []
        self._refused_until = 0.0

    def holds(self, holder: dict[Any, Any]) -> bool:
        return any(held is holder for held in self._holders)

    async def acquire(self, holder: dict[Any, Any], statement: str) -> None:
        """Wait for the turn of ``holder`` (a connection about to write)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # an engine used from another event loop than before
            self._loop, self._lock, self._owner, self._holders = loop, asyncio.Lock(), None, []
        task = asyncio.current_task()
        if self._holders and task is not None and task is self._owner:
            self._holders.append(holder)  # the task's turn already: waiting would be for itself
            return
        self._refuse_during_outage(statement)
        self.waiting += 1
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            raise SQLiteWriteUnavailable(
                statement,
                f"no turn to write within {self.queue_timeout_s:g} s "
                f"(XMARK_SQLITE_WRITE_QUEUE_TIMEOUT_S; {self.waiting} more writes waiting)",
            ) from None
        finally:
            self.waiting -= 1
        self._owner = task
        self._holders.append(holder)
        try:
            self._refuse_during_outage(statement)  # refused to a writer ahead while this one waited
        except SQLiteWriteUnavailable:
            self.release(holder)
            raise

    def release(self, holder: dict[Any, Any]) -> None:
        """``holder`` went back to the pool (committed, rolled back or closed)."""
        loop = self._loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop and not loop.is_closed():
            # a pool check-in outside the loop's thread (a connection collected as garbage there)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._release, holder)
                return
        self._release(holder)

    def _release(self, holder: dict[Any, Any]) -> None:
        for position, held in enumerate(self._holders):
            if held is holder:
                del self._holders[position]
                break
        else:
            return
        if not self._holders:
            self._owner = None
            if self._lock.locked():
                self._lock.release()

    def refused(self) -> None:
        """The holder could not take the file lock or use the file: for one busy timeout, writers
        fail at once rather than each wait as long again."""
        self._refused_until = time.monotonic() + self.refusal_window_s

    def _refuse_during_outage(self, statement: str) -> None:
        if time.monotonic() < self._refused_until:
            raise SQLiteWriteUnavailable(
                statement, "the database has just refused its write lock (locked by another process, or unreachable)"
            )


def install_write_gate(engine: AsyncEngine, gate: WriteGate) -> None:
    """Make every write on ``engine`` (a SQLite engine) wait for its turn at ``gate``."""

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _take_turn(
        conn: Connection, cursor: Any, statement: str, parameters: Any, context: ExecutionContext | None, many: bool
    ) -> None:
        holder = conn.info
        if gate.holds(holder) or not writes(statement, context):
            return
        await_(gate.acquire(holder, statement))
        dbapi_connection: Any = conn.connection.dbapi_connection
        driver: Any = conn.connection.driver_connection
        if dbapi_connection is None or driver is None or dbapi_connection.isolation_level is None:
            return  # autocommit: the statement is a transaction by itself
        if first_word(statement) != "BEGIN" and not driver.in_transaction:
            cursor.execute("BEGIN IMMEDIATE")

    @event.listens_for(engine.sync_engine, "handle_error")
    def _refused(context: ExceptionContext) -> None:
        connection = context.connection
        error = context.original_exception
        if connection is None or isinstance(error, SQLiteWriteUnavailable) or not is_outage(error):
            return
        with contextlib.suppress(Exception):  # a connection that can no longer say what it holds
            if gate.holds(connection.info):
                gate.refused()

    @event.listens_for(engine.sync_engine, "checkin")
    def _pass_turn(dbapi_connection: Any, record: Any) -> None:
        gate.release(record.info)
