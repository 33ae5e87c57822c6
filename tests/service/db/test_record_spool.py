"""The generation records' spool: rows the database does not take are kept on disk and drained
into it later, exactly once. The database is the real PostgreSQL test server (each test writes
into a keyed table of its own, dropped at the end); "down" is a loopback port nothing listens on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, UniqueConstraint, text
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.launch import free_port
from service.config import Settings
from service.db import RowWriter, create_engine, create_sessionmaker
from service.db.spool import GENERATION_KEY, RecordNotDurable, RecordSpool, SpooledWriter
from service.metrics import Metrics
from service.models import UTCDateTime
from tests.service.conftest import scratch_table


def _table() -> Table:
    return Table(
        f"spool_probe_{uuid.uuid4().hex[:8]}",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("request_id", String(64), nullable=False),
        Column("choice_index", Integer, nullable=False),
        Column("label", String(32), nullable=False),
        Column("created_at", UTCDateTime(), nullable=False),
        UniqueConstraint(*GENERATION_KEY),
    )


@pytest.fixture
async def table(admin: AsyncEngine) -> AsyncIterator[Table]:
    async with scratch_table(admin, _table()) as probe:
        yield probe


@pytest.fixture
async def gone(settings: Settings) -> AsyncIterator[AsyncEngine]:
    """An engine on a port nothing listens on: every connection is refused at once."""
    engine = create_engine(
        settings.model_copy(update={"database_url": f"postgresql+asyncpg://xmark@127.0.0.1:{free_port()}/xmark"})
    )
    try:
        yield engine
    finally:
        await engine.dispose()


def _row(request_id: str, index: int = 0, label: str = "x") -> dict[str, Any]:
    return {"request_id": request_id, "choice_index": index, "label": label, "created_at": datetime.now(UTC)}


async def _stored(admin: AsyncEngine, table: Table) -> list[tuple[str, int]]:
    async with admin.connect() as connection:
        result = await connection.execute(
            text(f"SELECT request_id, choice_index FROM {table.name} ORDER BY request_id, choice_index")
        )
        return [(r, i) for r, i in result]


def _spooled_writer(engine: AsyncEngine, table: Table, path: Path, metrics: Metrics) -> SpooledWriter:
    # a write past 2 s is spooled instead: 5x margin and more, every test here, all its writes
    # together, took 0.30 s or less
    writer = RowWriter(create_sessionmaker(engine), table, timeout_s=2.0, conflict=GENERATION_KEY)
    return SpooledWriter(writer, RecordSpool(path, table), metrics)


async def _close(records: SpooledWriter) -> None:
    await records.close(5.0)  # 5x margin and more: as above, 0.30 s or less for a whole test here
    await records.writer.close()


def _value(metric: Any) -> float:
    return float(metric._value.get())


async def test_spooled_rows_survive_a_reopen_with_their_values(tmp_path: Path, table: Table) -> None:
    path = tmp_path / "spool" / "generations.sqlite3"
    at = datetime(2026, 11, 23, 21, 0, 1, 123456, tzinfo=UTC)
    spool = RecordSpool(path, table)
    await spool.open()
    await spool.put([{**_row("r1", 0), "created_at": at}, {**_row("r1", 1), "label": "é"}])
    await spool.put([_row("r2")])
    assert await spool.waiting() == 3
    await spool.close()

    # the file is what a crash leaves: WAL journal, every commit synced
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert path.stat().st_mode & 0o077 == 0  # the rows may hold completion texts

    reopened = RecordSpool(path, table)
    await reopened.open()
    try:
        entries = await reopened.take(limit_rows=2)
        assert [len(entry.rows) for entry in entries] == [2]  # whole entries, about the limit
        first = entries[0].rows
        assert first[0]["created_at"] == at and first[0]["created_at"].tzinfo is not None
        assert first[1]["label"] == "é" and first[1]["choice_index"] == 1
        await reopened.remove([entries[0].id])
        assert await reopened.waiting() == 1
    finally:
        await reopened.close()


async def test_a_spool_refuses_what_it_cannot_store_faithfully(tmp_path: Path, table: Table) -> None:
    spool = RecordSpool(tmp_path / "s.sqlite3", table)
    await spool.open()
    try:
        with pytest.raises(TypeError):
            await spool.put([{**_row("r1"), "label": object()}])
        assert await spool.waiting() == 0
    finally:
        await spool.close()


async def test_naive_datetimes_stay_naive(tmp_path: Path) -> None:
    """A plain DateTime column gets back exactly what was put (UTCDateTime reads naive as UTC)."""
    plain = Table("t", MetaData(), Column("id", Integer, primary_key=True), Column("at", DateTime()))
    spool = RecordSpool(tmp_path / "s.sqlite3", plain)
    await spool.open()
    try:
        naive = datetime(2026, 1, 2, 3, 4, 5) + timedelta(microseconds=7)
        await spool.put([{"id": 1, "at": naive}])
        [entry] = await spool.take(10)
        assert entry.rows == [{"id": 1, "at": naive}]
    finally:
        await spool.close()


async def test_rows_the_database_does_not_take_are_spooled_then_drained_once(
    tmp_path: Path, gone: AsyncEngine, engine: AsyncEngine, admin: AsyncEngine, table: Table
) -> None:
    path = tmp_path / "spool.sqlite3"
    metrics = Metrics()
    down = _spooled_writer(gone, table, path, metrics)
    await down.open()
    try:
        assert await down.write([_row("a", 0), _row("a", 1)]) == "spool"
        assert down.spooling  # the database failed: the next records skip it
        assert await down.write([_row("b")], linger_s=5.0) == "spool"  # at once, no linger
    finally:
        await _close(down)
    assert _value(metrics.generation_records_spooled) == 3
    assert _value(metrics.generation_records_waiting) == 3
    assert _value(metrics.generation_records_dropped) == 0

    # the database answers again (a new process on the same spool file)
    up = _spooled_writer(engine, table, path, metrics)
    await up.open()
    try:
        assert await up.drain() == 3
        assert await up.drain() == 0
        assert not up.spooling
        assert await up.write([_row("c")]) == "database"
    finally:
        await _close(up)
    assert await _stored(admin, table) == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    assert _value(metrics.generation_records_drained) == 3
    assert _value(metrics.generation_records_waiting) == 0


async def test_a_drain_interrupted_between_insert_and_delete_duplicates_nothing(
    tmp_path: Path, engine: AsyncEngine, admin: AsyncEngine, table: Table
) -> None:
    """The rows reached the database (say, a write that timed out did commit, or the process
    died before deleting them from the spool): draining them again stores nothing twice."""
    metrics = Metrics()
    records = _spooled_writer(engine, table, tmp_path / "spool.sqlite3", metrics)
    await records.open()
    try:
        rows = [_row("r", 0), _row("r", 1)]
        await records.writer.write(rows)  # committed...
        await records.spool.put(rows)  # ...and spooled too
        await records.spool.put([_row("s")])
        assert await records.drain() == 3
        assert await records.spool.waiting() == 0
    finally:
        await _close(records)
    assert await _stored(admin, table) == [("r", 0), ("r", 1), ("s", 0)]


async def test_two_drainers_on_one_spool_file_store_each_row_once(
    tmp_path: Path, engine: AsyncEngine, admin: AsyncEngine, table: Table
) -> None:
    """Gateway processes of one host share the spool file; they may drain the same entries."""
    path = tmp_path / "spool.sqlite3"
    first = _spooled_writer(engine, table, path, Metrics())
    second = _spooled_writer(engine, table, path, Metrics())
    await first.open()
    await second.open()
    try:
        for i in range(50):
            await first.spool.put([_row(f"r{i:02d}", 0), _row(f"r{i:02d}", 1)])
        await asyncio.gather(first.drain(), second.drain())
        assert await first.spool.waiting() == 0
    finally:
        await _close(first)
        await _close(second)
    stored = await _stored(admin, table)
    assert len(stored) == 100 and len(set(stored)) == 100


async def test_a_row_the_database_refuses_is_set_aside_and_the_others_are_drained(
    tmp_path: Path, engine: AsyncEngine, admin: AsyncEngine, table: Table, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "spool.sqlite3"
    metrics = Metrics()
    records = _spooled_writer(engine, table, path, metrics)
    await records.open()
    try:
        await records.spool.put([_row("ok1")])
        await records.spool.put([{**_row("bad"), "label": "far too long for its column, which holds 32"}])
        await records.spool.put([_row("ok2")])
        with caplog.at_level(logging.ERROR, logger="xmark.records"):
            assert await records.drain() == 2
        assert await records.spool.waiting() == 0
    finally:
        await _close(records)
    assert await _stored(admin, table) == [("ok1", 0), ("ok2", 0)]
    assert _value(metrics.generation_records_dropped) == 1  # refused: worth an alert
    assert any("refused" in record.getMessage() for record in caplog.records)
    with sqlite3.connect(path) as raw:  # kept for an operator
        [(rows, error_type)] = raw.execute("SELECT rows, error_type FROM refused").fetchall()
    assert json.loads(rows)[0]["request_id"] == "bad" and error_type == "StringDataRightTruncationError"


async def test_a_live_write_the_database_refuses_is_set_aside_without_spooling_the_rest(
    tmp_path: Path, engine: AsyncEngine, admin: AsyncEngine, table: Table
) -> None:
    metrics = Metrics()
    records = _spooled_writer(engine, table, tmp_path / "spool.sqlite3", metrics)
    await records.open()
    try:
        with pytest.raises(RecordNotDurable):
            await records.write([{**_row("bad"), "label": "x" * 40}])
        assert not records.spooling  # a refusal is not an outage
        assert await records.write([_row("good")]) == "database"
    finally:
        await _close(records)
    assert await _stored(admin, table) == [("good", 0)]
    assert _value(metrics.generation_records_dropped) == 1
    assert _value(metrics.generation_records_spooled) == 0


async def test_when_the_spool_fails_too_the_rows_are_counted_as_dropped(
    tmp_path: Path, gone: AsyncEngine, table: Table
) -> None:
    metrics = Metrics()
    records = _spooled_writer(gone, table, tmp_path / "spool.sqlite3", metrics)
    await records.open()
    await records.spool.close()  # the disk is gone, say
    try:
        with pytest.raises(RecordNotDurable):
            await records.write([_row("a"), _row("a", 1)])
    finally:
        await records.writer.close()
    assert _value(metrics.generation_records_dropped) == 2


async def test_closing_spools_the_records_still_being_written(
    tmp_path: Path, engine: AsyncEngine, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway that shuts down while a write hangs keeps the rows: they are spooled, and the
    hung write, if it ever ends, changes nothing."""
    path = tmp_path / "spool.sqlite3"
    metrics = Metrics()
    records = _spooled_writer(engine, table, path, metrics)
    await records.open()
    never = asyncio.Event()

    async def hung(rows: Any, *, linger_s: float = 0.0) -> None:
        await never.wait()

    monkeypatch.setattr(records.writer, "write", hung)
    in_flight = asyncio.create_task(records.write([_row("hung", 0), _row("hung", 1)]))
    await asyncio.sleep(0.05)
    await records.close(0.1)
    assert _value(metrics.generation_records_spooled) == 2
    in_flight.cancel()
    with pytest.raises(asyncio.CancelledError):
        await in_flight
    assert _value(metrics.generation_records_spooled) == 2 and _value(metrics.generation_records_dropped) == 0
    await records.writer.close()
    again = RecordSpool(path, table)
    await again.open()
    try:
        assert await again.waiting() == 2
    finally:
        await again.close()


async def test_the_drainer_writes_rows_spooled_before_a_restart_at_once(
    tmp_path: Path, engine: AsyncEngine, admin: AsyncEngine, table: Table
) -> None:
    path = tmp_path / "spool.sqlite3"
    before = RecordSpool(path, table)
    await before.open()
    await before.put([_row("from-before")])
    await before.close()

    records = _spooled_writer(engine, table, path, Metrics())
    await records.open()
    drainer = asyncio.create_task(records.run_drainer(interval_s=3600))  # only its first pass counts
    try:
        # 5 s or more: 5x margin and more, the whole test took 0.21 s here
        for _ in range(100):
            if await _stored(admin, table):
                break
            await asyncio.sleep(0.05)
    finally:
        drainer.cancel()
        await _close(records)
    assert await _stored(admin, table) == [("from-before", 0)]
