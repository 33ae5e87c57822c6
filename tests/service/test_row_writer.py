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
from sqlalchemy import Boolean, Column, Integer, MetaData, String, Table, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from service.config import Settings
from service.db import RowWriter, create_engine, create_sessionmaker, session_scope
from service.models import UTCDateTime


@pytest.fixture
async def admin(settings: Settings, migrated_database: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(settings.database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


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
    async with admin.begin() as connection:
        await connection.run_sync(probe.create)
    try:
        yield probe
    finally:
        async with admin.begin() as connection:
            await connection.run_sync(probe.drop)


@pytest.fixture
async def engine(settings: Settings, migrated_database: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(settings)
    try:
        yield engine
    finally:
        await engine.dispose()


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
    """The number of rows of each executemany asyncpg sends (SQLAlchemy's events do not see them)."""
    calls: list[int] = []
    original = asyncpg.connection.Connection.executemany

    async def counted(self: Any, command: str, args: Any, *rest: Any, **kwargs: Any) -> Any:
        calls.append(len(args))
        return await original(self, command, args, *rest, **kwargs)

    monkeypatch.setattr(asyncpg.connection.Connection, "executemany", counted)
    return calls


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
    first = asyncio.create_task(writer.write([_row("lingering 1")], linger_s=0.3))
    second = asyncio.create_task(writer.write([_row("lingering 2")], linger_s=0.3))
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
    for _ in range(50):  # the event loop sees the server's goodbye shortly
        if writer._connection.is_closed():  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.02)
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
    original = asyncpg.connection.Connection.executemany

    async def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        await next(gates).wait()
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(asyncpg.connection.Connection, "executemany", held)
    in_flight = asyncio.create_task(writer.write([_row("one")]))
    await asyncio.sleep(0.05)
    queued = [asyncio.create_task(writer.write([_row(f"q{i}")])) for i in range(3)]
    await asyncio.sleep(0.05)  # the three wait behind the first
    opened.set()
    await in_flight
    await asyncio.sleep(0.05)  # the next batch (all three) is in flight
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
