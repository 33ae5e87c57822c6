"""Keys' last uses written after the responses, in batches (``service.services.last_use``), on a
migrated SQLite file of its own and on the shared PostgreSQL: one statement per batch, the latest
use of each key, never a later value overwritten by an earlier one, a retry after a fault, and a
last write at shutdown."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, make_url, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from service.db import create_engine, create_sessionmaker, session_scope, upgrade_database
from service.models import ApiKey, User
from service.services.last_use import LastUseRecorder
from tests.conftest import make_test_settings

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[tuple[AsyncEngine, async_sessionmaker[AsyncSession], list[int]]]:
    """A migrated SQLite file with three keys; yields the engine, its sessionmaker and the key ids."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'xmark.db'}"
    await asyncio.to_thread(upgrade_database, url)
    engine = create_engine(make_test_settings(tmp_path, database_url=url))
    sessionmaker = create_sessionmaker(engine)
    async with session_scope(sessionmaker) as session:
        user = User(name="u", role="user", message_id="0" * 32)
        session.add(user)
        await session.flush()
        keys = [ApiKey(user_id=user.id, prefix=f"xm_{i:05d}", key_hash=f"{i:064x}") for i in range(3)]
        session.add_all(keys)
        await session.flush()
        ids = [key.id for key in keys]
    try:
        yield engine, sessionmaker, ids
    finally:
        await engine.dispose()


async def _uses(sessionmaker: async_sessionmaker[AsyncSession]) -> dict[int, datetime | None]:
    async with session_scope(sessionmaker) as session:
        return {row.id: row.last_used_at for row in (await session.execute(select(ApiKey.id, ApiKey.last_used_at)))}


def _statements(engine: AsyncEngine) -> list[str]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.upper().startswith(("BEGIN", "SAVEPOINT", "RELEASE", "PRAGMA")):
            seen.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    return seen


async def test_a_batch_is_one_statement_with_the_latest_use_of_each_key(database: Any) -> None:
    engine, sessionmaker, (a, b, c) = database
    recorder = LastUseRecorder(sessionmaker)
    recorder.note(a, T0 + timedelta(minutes=3))
    recorder.note(a, T0 + timedelta(minutes=1))  # an earlier use noted later (requests overlap): kept out
    recorder.note(b, T0)
    assert recorder.pending == 2
    statements = _statements(engine)
    await recorder.flush()
    await recorder.flush()  # nothing pending: no statement
    assert [s.split()[0].upper() for s in statements] == ["UPDATE"]  # one statement, executed for both rows
    assert recorder.pending == 0 and recorder.written == 2
    assert await _uses(sessionmaker) == {a: T0 + timedelta(minutes=3), b: T0, c: None}


async def test_an_earlier_use_never_overwrites_a_later_one(database: Any) -> None:
    """Two replicas' batches may cross: the stored use only moves forward."""
    _, sessionmaker, (a, _, _) = database
    first, second = LastUseRecorder(sessionmaker), LastUseRecorder(sessionmaker)
    first.note(a, T0 + timedelta(minutes=5))
    await first.flush()
    second.note(a, T0 + timedelta(minutes=2))
    await second.flush()
    assert (await _uses(sessionmaker))[a] == T0 + timedelta(minutes=5)


async def test_a_failed_batch_stays_pending_and_the_writer_retries_it(database: Any) -> None:
    engine, sessionmaker, (a, b, _) = database
    recorder = LastUseRecorder(sessionmaker, interval_s=0.05)
    recorder.note(a, T0)
    # another program holds the file's write lock: the writes fail after the busy timeout
    blocker = sqlite3.connect(str(make_url(str(engine.url)).database), isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(OperationalError):
            await recorder.flush()
        assert recorder.pending == 1
        recorder.note(b, T0 + timedelta(minutes=1))  # noted while the batch failed
        recorder.start()
        # the background writer fails quietly meanwhile (a writer that has not tried yet leaves
        # both pending too: a slow machine tests less here, it fails nothing)
        await asyncio.sleep(1.5)
        assert recorder.pending == 2
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()
    # 5 s or more: 5x margin and more, the writer had written both 0.14 s or less after the lock
    # ended here (the whole test took 2.6 s: the failed flush's busy timeout, 1 s, and the 1.5 s)
    for _ in range(100):
        if recorder.pending == 0:
            break
        await asyncio.sleep(0.05)
    await recorder.close()
    uses = await _uses(sessionmaker)
    assert uses[a] == T0 and uses[b] == T0 + timedelta(minutes=1)


async def test_close_writes_what_is_pending(database: Any) -> None:
    _, sessionmaker, (a, _, _) = database
    recorder = LastUseRecorder(sessionmaker, interval_s=3600)  # the background writer never gets to it
    recorder.start()
    recorder.note(a, T0)
    await recorder.close()
    assert recorder.pending == 0
    assert (await _uses(sessionmaker))[a] == T0


async def test_on_postgresql_too(app: Any, db_session: AsyncSession, make_user: Any) -> None:
    """The same statement on PostgreSQL (inside the test's transaction)."""
    principal, _ = await make_user("user")
    key_id = await db_session.scalar(select(ApiKey.id).where(ApiKey.user_id == principal["id"]))
    assert key_id is not None
    recorder = LastUseRecorder(app.state.resources.sessionmaker)
    recorder.note(key_id, T0 + timedelta(minutes=1))
    await recorder.flush()
    recorder.note(key_id, T0)
    await recorder.flush()
    assert await db_session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id)) == T0 + timedelta(minutes=1)
