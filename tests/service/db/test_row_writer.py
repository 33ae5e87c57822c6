"""RowWriter on the real PostgreSQL: rows commit on the writer's own connection, concurrent writes
share a round trip, and a dropped or failed connection is replaced; elsewhere it falls back to a
unit of work. Each test writes into a table of its own, dropped at the end."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Boolean, Column, Integer, MetaData, String, Table, UniqueConstraint, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from service.config import Settings
from service.db import RowWriter, create_sessionmaker, session_scope
from service.models import UTCDateTime
from tests.service.conftest import scratch_table


@pytest.fixture
async def table(admin: AsyncEngine) -> AsyncIterator[Table]:
    probe = Table(
        f"row_writer_probe_{uuid.uuid4().hex[:8]}",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("label", String(32), nullable=False),
        Column("flag", Boolean, nullable=False),
        Column("at", UTCDateTime(), nullable=False),
    )
    async with scratch_table(admin, probe) as created:
        yield created


@pytest.fixture
async def writer(engine: AsyncEngine, table: Table) -> AsyncIterator[RowWriter]:
    writer = RowWriter(create_sessionmaker(engine), table)
    try:
        yield writer
    finally:
        await writer.close()


def _row(label: str, at: datetime | None = None) -> dict[str, Any]:
    return {"label": label, "flag": True, "at": at or datetime.now(UTC)}


async def _stored(admin: AsyncEngine, table: Table) -> list[tuple[str, bool, datetime]]:
    async with admin.connect() as connection:
        result = await connection.execute(text(f"SELECT label, flag, at FROM {table.name} ORDER BY id"))
        return [tuple(row) for row in result]  # type: ignore[misc]


@pytest.fixture
def executemany_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each executemany asyncpg sends into a probe table (SQLAlchemy's events
    do not see them); the process's other writers (the app's background ones) are not counted."""
    calls: list[int] = []
    original = asyncpg.connection.Connection.executemany

    async def counted(self: Any, command: str, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if "row_writer_" in command:  # the probe tables of these tests
            calls.append(len(args))
        return await original(self, command, args, *rest, **kwargs)

    monkeypatch.setattr(asyncpg.connection.Connection, "executemany", counted)
    return calls


async def _until(condition: Any, timeout_s: float) -> None:
    """Poll ``condition`` every 10 ms until it holds; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_rows_are_committed_when_write_returns(
    writer: RowWriter, admin: AsyncEngine, table: Table, executemany_calls: list[int]
) -> None:
    assert writer.direct
    naive = datetime(2026, 1, 2, 3, 4, 5)  # UTCDateTime's bind processing reads it as UTC
    await writer.write([_row("a", naive), _row("b")])
    stored = await _stored(admin, table)
    assert [(label, flag) for label, flag, _ in stored] == [("a", True), ("b", True)]
    assert stored[0][2] == naive.replace(tzinfo=UTC)
    assert executemany_calls == [2]  # both rows in one statement
    await writer.write([_row("c")])
    assert [label for label, _, _ in await _stored(admin, table)] == ["a", "b", "c"]


async def test_writes_that_arrive_during_one_in_flight_share_the_next_round_trip(
    writer: RowWriter, admin: AsyncEngine, table: Table, executemany_calls: list[int]
) -> None:
    await writer.write([_row("warm")])  # the connection and the prepared statement exist
    executemany_calls.clear()
    await asyncio.gather(*(writer.write([_row(f"r{i}")]) for i in range(20)))
    assert sum(executemany_calls) == 20
    assert executemany_calls[0] == 1 and len(executemany_calls) < 20  # the first went alone, the rest together
    assert len(await _stored(admin, table)) == 21


async def test_a_lingering_write_waits_and_rows_arriving_meanwhile_share_its_statement(
    writer: RowWriter, admin: AsyncEngine, table: Table, executemany_calls: list[int]
) -> None:
    await writer.write([_row("warm")])
    executemany_calls.clear()
    started = time.perf_counter()
    await writer.write([_row("alone")], linger_s=0.1)
    assert time.perf_counter() - started >= 0.1 and executemany_calls == [1]
    executemany_calls.clear()
    # lingering 1 s: 5x margin and more over the sleep below (0.05 s here) before they are looked at
    first = asyncio.create_task(writer.write([_row("lingering 1")], linger_s=1.0))
    second = asyncio.create_task(writer.write([_row("lingering 2")], linger_s=1.0))
    await asyncio.sleep(0.05)
    assert executemany_calls == []  # still lingering
    await writer.write([_row("at once")])  # takes the lingering rows along
    assert executemany_calls == [3]
    assert [label for label, _, _ in await _stored(admin, table)][-3:] == ["lingering 1", "lingering 2", "at once"]
    await asyncio.gather(first, second)
    assert executemany_calls == [3]  # nothing left for them to send


async def test_a_refused_row_fails_its_write_and_the_connection_stays(
    writer: RowWriter, admin: AsyncEngine, table: Table
) -> None:
    await writer.write([_row("ok")])
    pid = writer._connection.get_server_pid()  # type: ignore[union-attr]
    with pytest.raises(asyncpg.NotNullViolationError):
        await writer.write([{"label": None, "flag": True, "at": datetime.now(UTC)}])
    await writer.write([_row("after")])
    assert writer._connection.get_server_pid() == pid  # type: ignore[union-attr]
    assert [label for label, _, _ in await _stored(admin, table)] == ["ok", "after"]


async def test_a_connection_the_server_closed_is_replaced(writer: RowWriter, admin: AsyncEngine, table: Table) -> None:
    await writer.write([_row("before")])
    pid = writer._connection.get_server_pid()  # type: ignore[union-attr]
    async with admin.connect() as connection:
        assert await connection.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    # the event loop sees the server's goodbye shortly: 5x margin and more, it had seen it when
    # the termination returned here (under 1 ms)
    await _until(lambda: writer._connection.is_closed(), 10)  # type: ignore[union-attr]
    await writer.write([_row("after")])
    assert writer._connection.get_server_pid() != pid  # type: ignore[union-attr]
    assert [label for label, _, _ in await _stored(admin, table)] == ["before", "after"]


async def test_a_write_that_fails_midway_drops_the_connection_and_fails_its_whole_batch(
    writer: RowWriter, admin: AsyncEngine, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    await writer.write([_row("warm")])
    first = writer._connection
    opened, never = asyncio.Event(), asyncio.Event()
    gates = iter([opened, never])  # one per statement
    held_statements: list[int] = []  # the rows of each statement held at its gate
    original = asyncpg.connection.Connection.executemany

    async def held(self: Any, command: str, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if self is first:  # the writer's own statements; the process's other writers pass
            held_statements.append(len(args))
            await next(gates).wait()
        return await original(self, command, args, *rest, **kwargs)

    monkeypatch.setattr(asyncpg.connection.Connection, "executemany", held)
    in_flight = asyncio.create_task(writer.write([_row("one")]))
    await _until(lambda: held_statements == [1], 10)  # its statement is sent: 5x margin and more, 0.01 s here
    queued = [asyncio.create_task(writer.write([_row(f"q{i}")])) for i in range(3)]
    await asyncio.sleep(0.05)  # the three wait behind the first (they are queued at once: no I/O)
    opened.set()
    await in_flight
    # the next batch (all three) is in flight: 5x margin and more, under 1 ms here
    await _until(lambda: held_statements == [1, 3], 10)
    queued[0].cancel()  # its writer goes away midway: the statement's fate is unknown
    results = await asyncio.gather(*queued, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(isinstance(r, ConnectionError) for r in results[1:])
    assert first.is_closed() and writer._connection is None
    monkeypatch.setattr(asyncpg.connection.Connection, "executemany", original)
    await writer.write([_row("retried")])  # a fresh connection
    assert [label for label, _, _ in await _stored(admin, table)] == ["warm", "one", "retried"]


async def test_a_sessionmaker_bound_to_a_connection_writes_in_its_transaction(
    engine: AsyncEngine, admin: AsyncEngine, table: Table
) -> None:
    async with engine.connect() as connection:
        outer = await connection.begin()
        sessionmaker = create_sessionmaker(engine)
        sessionmaker.configure(bind=connection, join_transaction_mode="create_savepoint")
        writer = RowWriter(sessionmaker, table)
        assert not writer.direct
        await writer.write([_row("inside")])
        async with session_scope(sessionmaker) as session:
            assert await session.scalar(text(f"SELECT count(*) FROM {table.name}")) == 1
        assert await _stored(admin, table) == []  # not committed: the outer transaction owns it
        await outer.rollback()
    assert await _stored(admin, table) == []
    assert writer._connection is None


async def test_sqlite_writes_through_a_unit_of_work(tmp_path: Any, table: Table) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine as create

    engine = create(f"sqlite+aiosqlite:///{tmp_path / 'rows.db'}")
    try:
        async with engine.begin() as connection:
            await connection.run_sync(table.create)
        writer = RowWriter(create_sessionmaker(engine), table)
        assert not writer.direct
        await writer.write([_row("x"), _row("y")])
        async with engine.connect() as connection:
            assert await connection.scalar(text(f"SELECT count(*) FROM {table.name}")) == 2
        await writer.close()
    finally:
        await engine.dispose()


async def test_prepared_statements_are_kept_unless_the_url_switches_their_cache_off(
    settings: Settings, writer: RowWriter, admin: AsyncEngine, table: Table
) -> None:
    prepared = "SELECT count(*) FROM pg_prepared_statements"
    await writer.write([_row("cached")])
    assert await writer._connection.fetchval(prepared) >= 1  # type: ignore[union-attr]
    url = make_url(settings.database_url).update_query_dict({"prepared_statement_cache_size": "0"})
    pooler_friendly = create_async_engine(url)
    uncached = RowWriter(create_sessionmaker(pooler_friendly), table)
    try:
        await uncached.write([_row("uncached")])
        await uncached.write([_row("uncached again")])
        assert await uncached._connection.fetchval(prepared) == 0  # type: ignore[union-attr]
    finally:
        await uncached.close()
        await pooler_friendly.dispose()
    assert [label for label, _, _ in await _stored(admin, table)] == ["cached", "uncached", "uncached again"]


# -- idempotent writes: a conflict key skips rows already stored ------------------------------


def _keyed(metadata: MetaData | None = None) -> Table:
    return Table(
        f"row_writer_keyed_{uuid.uuid4().hex[:8]}",
        metadata or MetaData(),
        Column("id", Integer, primary_key=True),
        Column("request_id", String(64), nullable=False),
        Column("choice_index", Integer, nullable=False),
        Column("label", String(32), nullable=False),
        Column("at", UTCDateTime(), nullable=False),
        UniqueConstraint("request_id", "choice_index"),
    )


@pytest.fixture
async def keyed_table(admin: AsyncEngine) -> AsyncIterator[Table]:
    async with scratch_table(admin, _keyed()) as keyed:
        yield keyed


def _choice(request_id: str, index: int, label: str = "x") -> dict[str, Any]:
    return {"request_id": request_id, "choice_index": index, "label": label, "at": datetime.now(UTC)}


async def _keys(engine: AsyncEngine, table: Table) -> list[tuple[str, int, str]]:
    async with engine.connect() as connection:
        result = await connection.execute(
            text(f"SELECT request_id, choice_index, label FROM {table.name} ORDER BY request_id, choice_index")
        )
        return [tuple(row) for row in result]  # type: ignore[misc]


async def test_with_a_conflict_key_writing_the_same_rows_again_stores_them_once(
    engine: AsyncEngine, admin: AsyncEngine, keyed_table: Table
) -> None:
    writer = RowWriter(create_sessionmaker(engine), keyed_table, conflict=("request_id", "choice_index"))
    try:
        assert writer.direct
        rows = [_choice("r1", 0, "first"), _choice("r1", 1, "first")]
        await writer.write(rows)
        # the retry of a write that timed out after its commit, a spooled row drained again
        await writer.write([_choice("r1", 0, "again"), _choice("r1", 1, "again"), _choice("r2", 0)])
        # two concurrent writes of one row share a statement: still one row
        await asyncio.gather(writer.write([_choice("r3", 0, "a")]), writer.write([_choice("r3", 0, "b")]))
    finally:
        await writer.close()
    stored = await _keys(admin, keyed_table)
    assert [(r, i) for r, i, _ in stored] == [("r1", 0), ("r1", 1), ("r2", 0), ("r3", 0)]
    assert [label for _, _, label in stored][:2] == ["first", "first"]  # the first write's rows are kept


async def test_without_a_conflict_key_a_duplicate_is_refused(
    engine: AsyncEngine, admin: AsyncEngine, keyed_table: Table
) -> None:
    """The traces table has no such key: its writer inserts plainly (and a unique violation would
    be an error, not silently skipped)."""
    writer = RowWriter(create_sessionmaker(engine), keyed_table)
    try:
        await writer.write([_choice("r1", 0)])
        with pytest.raises(asyncpg.UniqueViolationError):
            await writer.write([_choice("r1", 0)])
    finally:
        await writer.close()
    assert len(await _keys(admin, keyed_table)) == 1


async def test_a_refused_row_fails_only_its_own_write_in_a_shared_statement(
    engine: AsyncEngine, admin: AsyncEngine, keyed_table: Table, executemany_calls: list[int]
) -> None:
    writer = RowWriter(create_sessionmaker(engine), keyed_table, conflict=("request_id", "choice_index"))
    try:
        await writer.write([_choice("warm", 0)])
        executemany_calls.clear()
        bad = {"request_id": "bad", "choice_index": 0, "label": None, "at": datetime.now(UTC)}
        results = await asyncio.gather(
            writer.write([_choice("a", 0)], linger_s=0.05),
            writer.write([bad], linger_s=0.05),
            writer.write([_choice("b", 0), _choice("b", 1)], linger_s=0.05),
            return_exceptions=True,
        )
    finally:
        await writer.close()
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], asyncpg.NotNullViolationError)
    assert executemany_calls[0] == 4  # they shared one statement first, then went one by one
    assert [(r, i) for r, i, _ in await _keys(admin, keyed_table)] == [("a", 0), ("b", 0), ("b", 1), ("warm", 0)]


async def test_sqlite_with_a_conflict_key_stores_each_row_once(tmp_path: Any) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine as create

    keyed = _keyed()
    engine = create(f"sqlite+aiosqlite:///{tmp_path / 'rows.db'}")
    try:
        async with engine.begin() as connection:
            await connection.run_sync(keyed.create)
        writer = RowWriter(create_sessionmaker(engine), keyed, conflict=("request_id", "choice_index"))
        assert not writer.direct
        await writer.write([_choice("r1", 0), _choice("r1", 1)])
        await writer.write([_choice("r1", 1), _choice("r2", 0)])
        assert [(r, i) for r, i, _ in await _keys(engine, keyed)] == [("r1", 0), ("r1", 1), ("r2", 0)]
    finally:
        await engine.dispose()


async def test_a_connection_bound_writer_with_a_conflict_key_skips_stored_rows(
    engine: AsyncEngine, admin: AsyncEngine, keyed_table: Table
) -> None:
    async with engine.connect() as connection:
        outer = await connection.begin()
        sessionmaker = create_sessionmaker(engine)
        sessionmaker.configure(bind=connection, join_transaction_mode="create_savepoint")
        writer = RowWriter(sessionmaker, keyed_table, conflict=("request_id", "choice_index"))
        await writer.write([_choice("r1", 0)])
        await writer.write([_choice("r1", 0), _choice("r1", 1)])
        async with session_scope(sessionmaker) as session:
            assert await session.scalar(text(f"SELECT count(*) FROM {keyed_table.name}")) == 2
        await outer.rollback()
