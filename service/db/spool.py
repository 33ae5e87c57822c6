"""Generation records that the database cannot take now wait in a durable local spool.

``RecordSpool`` is a SQLite file under the var dir (WAL, ``synchronous=FULL``: an entry put is on
disk when ``put`` returns), used from one thread of its own so that the event loop never waits
for the disk. Each entry holds the rows of one completion as JSON.

``SpooledWriter`` is what the gateway records completions through: rows go to the database (one
quick retry), and when it does not take them in time they go to the spool instead; while the
spool holds rows, new records join them there without trying the database, so an outage costs
each completion one local write rather than a database timeout. A background task
(``run_drainer``) writes the spooled rows into the database whenever it answers again, also
right after a restart, and only then deletes them from the spool. The database insert skips a
row whose (request id, choice index) is already stored, so a crash between the two steps, a
write that timed out but did commit, or two processes draining the same file never duplicate a
record. What reaches neither is counted as dropped (``xmark_generation_records_dropped_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.types import TypeDecorator, TypeEngine

from service.config import Settings
from service.db.row_writer import RowWriter, refused
from service.exceptions import ServiceError

if TYPE_CHECKING:
    from service.metrics import Metrics

logger = logging.getLogger("xmark.records")

SPOOL_FILE = Path("spool") / "generations.sqlite3"
# The unique key of a generation record: its insert skips a row already stored.
GENERATION_KEY = ("request_id", "choice_index")

# The pause before the one retry of a write that failed fast (a connection reset by a restarting
# server); a write that timed out goes to the spool at once: a hung server would not answer the
# retry either, and every second spent here keeps the record in memory only.
RETRY_PAUSE_S = 0.2
# Rows written into the database per statement while draining.
DRAIN_BATCH_ROWS = 500

Destination = Literal["database", "spool"]


@dataclass(frozen=True)
class SpooledEntry:
    id: int
    rows: list[dict[str, Any]]


class RecordNotDurable(ServiceError):
    """Neither the database nor the spool took the rows (they are counted as dropped)."""

    def __init__(self, error_type: str) -> None:
        super().__init__(f"record not durable ({error_type})")
        self.error_type = error_type


class RecordSpool:
    """A durable queue of row batches in a SQLite file; every method runs on the spool's own thread."""

    def __init__(self, path: Path, table: Table) -> None:
        self.path = path
        # datetimes travel as ISO text and are read back for the columns that hold them
        self._datetime_columns = frozenset(
            column.name for column in table.columns if _python_type(column.type) is datetime
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-spool")
        self._connection: sqlite3.Connection | None = None

    async def _run(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    # -- on the spool's thread ---------------------------------------------------------------

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(mode=0o600, exist_ok=True)  # the rows may hold completion texts
        connection = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA busy_timeout=30000")  # other gateway processes share the file
        connection.execute(
            "CREATE TABLE IF NOT EXISTS records ("
            "id INTEGER PRIMARY KEY AUTOINCREMENT, rows TEXT NOT NULL, row_count INTEGER NOT NULL, "
            "spooled_at REAL NOT NULL)"
        )
        # rows the database refused (a constraint, a bad value): kept for an operator, not retried
        connection.execute(
            "CREATE TABLE IF NOT EXISTS refused ("
            "id INTEGER PRIMARY KEY AUTOINCREMENT, rows TEXT NOT NULL, row_count INTEGER NOT NULL, "
            "refused_at REAL NOT NULL, error_type TEXT NOT NULL)"
        )
        self._connection = connection

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            raise RuntimeError("the record spool is closed")
        return self._connection

    def _waiting_sync(self) -> int:
        return int(self._db().execute("SELECT coalesce(sum(row_count), 0) FROM records").fetchone()[0])

    def _put_sync(self, payload: str, count: int) -> None:
        with self._db():  # one transaction, on disk when it commits
            self._db().execute(
                "INSERT INTO records (rows, row_count, spooled_at) VALUES (?, ?, ?)", (payload, count, time.time())
            )

    def _take_sync(self, limit_rows: int) -> list[tuple[int, str]]:
        taken: list[tuple[int, str]] = []
        rows = 0
        for entry_id, payload, count in self._db().execute("SELECT id, rows, row_count FROM records ORDER BY id"):
            if taken and rows + count > limit_rows:
                break
            taken.append((entry_id, payload))
            rows += count
        return taken

    def _remove_sync(self, ids: list[int]) -> None:
        with self._db():
            self._db().executemany("DELETE FROM records WHERE id = ?", [(i,) for i in ids])

    def _set_aside_sync(self, entry_id: int, error_type: str) -> None:
        with self._db():
            self._db().execute(
                "INSERT INTO refused (rows, row_count, refused_at, error_type) "
                "SELECT rows, row_count, ?, ? FROM records WHERE id = ?",
                (time.time(), error_type, entry_id),
            )
            self._db().execute("DELETE FROM records WHERE id = ?", (entry_id,))

    def _refuse_sync(self, payload: str, count: int, error_type: str) -> None:
        with self._db():
            self._db().execute(
                "INSERT INTO refused (rows, row_count, refused_at, error_type) VALUES (?, ?, ?, ?)",
                (payload, count, time.time(), error_type),
            )

    def _close_sync(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    # -- from the event loop -----------------------------------------------------------------

    def _encode(self, rows: Sequence[Mapping[str, Any]]) -> str:
        return json.dumps([dict(row) for row in rows], default=_encode_value, separators=(",", ":"))

    def _decode(self, payload: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = json.loads(payload)
        for row in rows:
            for name in self._datetime_columns.intersection(row):
                if row[name] is not None:
                    row[name] = datetime.fromisoformat(row[name])
        return rows

    async def open(self) -> None:
        await self._run(self._open_sync)

    async def waiting(self) -> int:
        """Rows in the spool (every process's: the file is shared)."""
        return int(await self._run(self._waiting_sync))

    async def put(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Store ``rows`` as one entry; on disk when this returns."""
        await self._run(self._put_sync, self._encode(rows), len(rows))

    async def take(self, limit_rows: int) -> list[SpooledEntry]:
        """The oldest entries, about ``limit_rows`` rows in all (at least one entry); they stay
        in the spool until ``remove``."""
        taken = await self._run(self._take_sync, limit_rows)
        return [SpooledEntry(entry_id, self._decode(payload)) for entry_id, payload in taken]

    async def remove(self, ids: list[int]) -> None:
        await self._run(self._remove_sync, ids)

    async def set_aside(self, entry_id: int, error_type: str) -> None:
        """Move a spooled entry the database refused to the ``refused`` table."""
        await self._run(self._set_aside_sync, entry_id, error_type)

    async def refuse(self, rows: Sequence[Mapping[str, Any]], error_type: str) -> None:
        """Keep rows the database refused in the ``refused`` table."""
        await self._run(self._refuse_sync, self._encode(rows), len(rows), error_type)

    async def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # the executor is already shut down
            await self._run(self._close_sync)
        self._executor.shutdown(wait=False)


def _python_type(type_: TypeEngine[Any]) -> type | None:
    if isinstance(type_, TypeDecorator):  # e.g. UTCDateTime: what it stores
        type_ = type_.impl_instance
    try:
        return type_.python_type
    except NotImplementedError:
        return None


def _encode_value(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"a {type(value).__name__} cannot be spooled")


class SpooledWriter:
    """Records rows in the database, or in the spool when the database does not take them."""

    def __init__(self, writer: RowWriter, spool: RecordSpool, metrics: Metrics) -> None:
        self.writer = writer
        self.spool = spool
        self._metrics = metrics
        # the database failed a write and the spool has not been drained since: records go
        # straight to the spool
        self._spooling = False
        self._drain_lock = asyncio.Lock()
        # rows being written now (in memory only), by token: ``close`` spools what is left
        self._in_memory: dict[int, Sequence[Mapping[str, Any]]] = {}
        self._rescued: set[int] = set()
        self._tokens = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    @property
    def direct(self) -> bool:
        return self.writer.direct

    @property
    def in_flight(self) -> int:
        """Writes under way now (each a completion's rows, in the database's or the spool's hands)."""
        return len(self._in_memory)

    @property
    def spooling(self) -> bool:
        """Whether new records go to the spool (the database failed and has not been drained into since)."""
        return self._spooling

    async def open(self) -> None:
        await self.spool.open()
        waiting = await self.spool.waiting()
        self._metrics.generation_records_waiting.set(waiting)
        if waiting:
            logger.warning("generation records wait in the spool from before", extra={"rows": waiting})

    async def write(self, rows: Sequence[Mapping[str, Any]], *, linger_s: float = 0.0) -> Destination:
        """Make ``rows`` durable: committed in the database, or else in the spool. Raises
        ``RecordNotDurable`` (counted as dropped) only when the spool cannot take them either."""
        if not rows:
            return "database"
        token = next(self._tokens)
        self._in_memory[token] = rows
        self._idle.clear()
        try:
            if self._spooling:
                return await self._to_spool(rows, "spooling", token)
            try:
                await self._attempt(rows, linger_s)
                return "database"
            except asyncio.CancelledError:
                # the caller went away mid-write (its outcome unknown): the spool keeps the rows
                await asyncio.shield(self._to_spool(rows, "CancelledError", token))
                raise
            except Exception as exc:
                if refused(exc):
                    await self._refused(rows, type(exc).__name__)
                    raise RecordNotDurable(type(exc).__name__) from None
                error_type = type(exc).__name__
            if not self._spooling:
                self._spooling = True
                logger.warning(
                    "the database does not take generation records: spooling them", extra={"error_type": error_type}
                )
            return await self._to_spool(rows, error_type, token)
        finally:
            self._in_memory.pop(token, None)
            self._rescued.discard(token)
            if not self._in_memory:
                self._idle.set()

    async def _attempt(self, rows: Sequence[Mapping[str, Any]], linger_s: float) -> None:
        try:
            await self.writer.write(rows, linger_s=linger_s)
        except Exception as exc:
            if refused(exc) or isinstance(exc, TimeoutError) or self._spooling:
                raise
            await asyncio.sleep(RETRY_PAUSE_S)  # e.g. a connection the restarted server reset
            await self.writer.write(rows)

    async def _to_spool(
        self, rows: Sequence[Mapping[str, Any]], error_type: str, token: int | None = None
    ) -> Destination:
        if token is not None and token in self._rescued:  # ``close`` has spooled them already
            return "spool"
        try:
            await self.spool.put(rows)
        except Exception as exc:
            self._metrics.generation_records_dropped.inc(len(rows))
            logger.error(
                "generation record spool failed",
                extra={"error_type": type(exc).__name__, "database_error_type": error_type, "rows": len(rows)},
            )
            raise RecordNotDurable(type(exc).__name__) from None
        self._metrics.generation_records_spooled.inc(len(rows))
        self._metrics.generation_records_waiting.inc(len(rows))
        return "spool"

    async def _refused(self, rows: Sequence[Mapping[str, Any]], error_type: str) -> None:
        """Rows the database refused are kept in the spool's ``refused`` table and counted as dropped."""
        self._metrics.generation_records_dropped.inc(len(rows))
        logger.error(
            "the database refused generation records: kept in the spool's refused table",
            extra={"error_type": error_type, "rows": len(rows), "spool": str(self.spool.path)},
        )
        with contextlib.suppress(Exception):
            await self.spool.refuse(rows, error_type)

    # -- draining ----------------------------------------------------------------------------

    async def drain(self) -> int:
        """Write every spooled row into the database and delete it from the spool; the rows
        drained. Raises when the database fails (what was not drained stays spooled)."""
        async with self._drain_lock:
            drained = 0
            try:
                while entries := await self.spool.take(DRAIN_BATCH_ROWS):
                    drained += await self._drain_entries(entries)
                self._spooling = False
            finally:
                self._metrics.generation_records_waiting.set(await self.spool.waiting())
            return drained

    async def _drain_entries(self, entries: list[SpooledEntry]) -> int:
        rows = [row for entry in entries for row in entry.rows]
        try:
            await self.writer.write(rows)
        except Exception as exc:
            if not refused(exc):
                raise
            # some entry is refused: the others one at a time, the refused ones set aside
            written = 0
            for entry in entries:
                try:
                    await self.writer.write(entry.rows)
                except Exception as single:
                    if not refused(single):
                        raise
                    await self.spool.set_aside(entry.id, type(single).__name__)
                    self._metrics.generation_records_dropped.inc(len(entry.rows))
                    logger.error(
                        "the database refused spooled generation records: kept in the spool's refused table",
                        extra={"error_type": type(single).__name__, "rows": len(entry.rows)},
                    )
                    continue
                await self.spool.remove([entry.id])
                self._metrics.generation_records_drained.inc(len(entry.rows))
                written += len(entry.rows)
            return written
        await self.spool.remove([entry.id for entry in entries])
        self._metrics.generation_records_drained.inc(len(rows))
        return len(rows)

    async def run_drainer(self, interval_s: float) -> None:
        """Drain the spool now (rows spooled before a restart) and then every ``interval_s``."""
        failing = False
        while True:
            try:
                if await self.spool.waiting() > 0:
                    drained = await self.drain()
                    if drained:
                        logger.info("spooled generation records written to the database", extra={"rows": drained})
                else:
                    self._spooling = False
                failing = False
            except Exception as exc:
                if not failing:  # once per outage
                    logger.warning(
                        "spooled generation records wait for the database", extra={"error_type": type(exc).__name__}
                    )
                failing = True
            await asyncio.sleep(interval_s)

    # -- shutdown ----------------------------------------------------------------------------

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the records being written, spool those still in memory
        then, and close the spool."""
        if self._closed:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        for token, rows in list(self._in_memory.items()):
            self._rescued.add(token)  # their writer, if it ever resumes, leaves the spool alone
            with contextlib.suppress(RecordNotDurable):
                await self._to_spool(rows, "shutdown")
        self._closed = True
        await self.spool.close()


def record_write_timeout_s(settings: Settings) -> float:
    """The bound on one attempt at writing records (connect, or one statement): twice the
    requests' database timeout, since one group commit may carry many completions' rows, and at
    least a second; past it the rows go to the spool."""
    return max(1.0, 2 * settings.database_timeout_s)


@asynccontextmanager
async def open_generation_records(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession], table: Table, metrics: Metrics
) -> AsyncIterator[SpooledWriter]:
    """The generation records' writer with its spool (``var_dir/spool/generations.sqlite3``)
    and drainer. On exit the drainer stops, the records still being written are waited for
    (or else spooled), and the spool and the writer's connection are closed."""
    timeout_s = record_write_timeout_s(settings)
    writer = RowWriter(sessionmaker, table, timeout_s=timeout_s, conflict=GENERATION_KEY)
    records = SpooledWriter(writer, RecordSpool(settings.var_dir / SPOOL_FILE, table), metrics)
    try:
        await records.open()
        drainer = asyncio.create_task(records.run_drainer(settings.record_spool_drain_interval_s))
        try:
            yield records
        finally:
            drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drainer
            # a write waits for a batch in flight, then sends its own, with a pause and a retry
            await records.close(3 * timeout_s + RETRY_PAUSE_S + 1.0)
    finally:
        await records.close(0)
        await writer.close()
