"""Alembic migrations: up, down and up again on SQLite and PostgreSQL; models match the schema."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.db import alembic_config, downgrade_database, upgrade_database
from service.models import Base, include_object

TABLES = {
    "users",
    "api_keys",
    "key_versions",
    "generations",
    "traces",
    "message_ids",
    "registry_audit",
    "registry_audit_head",
    "end_users",
    "end_user_tallies",
}


async def _inspect(url: str) -> tuple[set[str], list[Any]]:
    engine = create_async_engine(url, poolclass=NullPool)

    def run(connection: Connection) -> tuple[set[str], list[Any]]:
        tables = set(inspect(connection).get_table_names())
        context = MigrationContext.configure(connection, opts={"compare_type": True, "include_object": include_object})
        diff = compare_metadata(context, Base.metadata)
        return tables, diff

    try:
        async with engine.connect() as connection:
            return await connection.run_sync(run)
    finally:
        await engine.dispose()


async def _round_trip(url: str) -> None:
    await asyncio.to_thread(upgrade_database, url)
    tables, diff = await _inspect(url)
    assert tables >= TABLES
    assert diff == [], f"models and migrations disagree: {diff}"

    await asyncio.to_thread(downgrade_database, url, "base")
    tables, _ = await _inspect(url)
    assert tables & TABLES == set()

    await asyncio.to_thread(upgrade_database, url)
    tables, _ = await _inspect(url)
    assert tables >= TABLES


async def test_sqlite_up_down_up(tmp_path: Path) -> None:
    await _round_trip(f"sqlite+aiosqlite:///{tmp_path / 'nested' / 'm.db'}")


@pytest.fixture
async def scratch_postgres(settings: Any) -> AsyncIterator[str]:
    """A throw-away PostgreSQL database on the test server."""
    url = sibling_url(settings.database_url, f"xmark_mig_{uuid.uuid4().hex[:10]}")
    try:
        await create_database(url)
        yield url
    finally:
        await drop_database(url)


@pytest.mark.postgres
async def test_postgres_up_down_up(scratch_postgres: str) -> None:
    await _round_trip(scratch_postgres)


# users of a 16-bit deployment before revision 0003: the key version uses blocks of 4 bits; carol's
# 10-bit ID has no key version of its length (block_bits falls back to 2)
_USERS_0002 = [
    ("alice", "active", "0110100111000101"),
    ("bob", "deleted", "1001011000111010"),
    ("carol", "active", "1100110011"),
]


async def _execute(url: str, statement: str, rows: list[dict[str, Any]] | None = None) -> list[Any]:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as connection:
            result = await connection.execute(text(statement), rows)
            return list(result.all()) if result.returns_rows else []
    finally:
        await engine.dispose()


async def _message_ids_backfill(url: str) -> None:
    """0003 copies every user's ID into message_ids; downgrading drops the table, users keep theirs."""
    await asyncio.to_thread(upgrade_database, url, "0002")
    now = datetime.now(UTC)
    await _execute(
        url,
        "INSERT INTO key_versions (name, bits, block_bits, num_keys, delta, scheme, fingerprint, status, created_at) "
        "VALUES ('v1', 16, 4, 2, 2.0, 'xmark', :fingerprint, 'active', :now)",
        [{"fingerprint": "f" * 64, "now": now}],
    )
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES (:name, 'user', :status, :message_id, :now, :now)",
        [{"name": n, "status": st, "message_id": m, "now": now} for n, st, m in _USERS_0002],
    )
    await asyncio.to_thread(upgrade_database, url, "0003")
    rows = await _execute(
        url,
        "SELECT users.name, message_ids.bits, message_ids.block_bits, message_ids.message_id "
        "FROM message_ids JOIN users ON users.id = message_ids.user_id ORDER BY users.name",
    )
    assert [tuple(r) for r in rows] == [
        ("alice", 16, 4, "0110100111000101"),
        ("bob", 16, 4, "1001011000111010"),  # deleted users keep theirs
        ("carol", 10, 2, "1100110011"),
    ]
    tables, _ = await _inspect(url)
    assert "message_ids" in tables  # the models are compared with the head revision elsewhere

    await asyncio.to_thread(downgrade_database, url, "0002")
    tables, _ = await _inspect(url)
    assert "message_ids" not in tables
    kept = await _execute(url, "SELECT name, message_id FROM users ORDER BY name")
    assert [tuple(r) for r in kept] == [(n, m) for n, _, m in _USERS_0002]
    await asyncio.to_thread(upgrade_database, url)
    assert len(await _execute(url, "SELECT id FROM message_ids")) == 3


async def test_sqlite_message_ids_backfill(tmp_path: Path) -> None:
    await _message_ids_backfill(f"sqlite+aiosqlite:///{tmp_path / 'b.db'}")


@pytest.mark.postgres
async def test_postgres_message_ids_backfill(scratch_postgres: str) -> None:
    await _message_ids_backfill(scratch_postgres)


async def test_the_test_database_is_at_head(migrated_database: str) -> None:
    engine = create_async_engine(migrated_database, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            version = await connection.scalar(text("SELECT version_num FROM alembic_version"))
    finally:
        await engine.dispose()
    assert version == ScriptDirectory.from_config(alembic_config(migrated_database)).get_current_head()


async def _choice_index_backfill(url: str) -> None:
    """0004 numbers the rows of each request in insertion order; the unique key then refuses a
    second row for the same (request, choice)."""
    await asyncio.to_thread(upgrade_database, url, "0003")
    now = datetime.now(UTC).replace(tzinfo=None)
    await _execute(
        url,
        "INSERT INTO key_versions (name, bits, block_bits, num_keys, delta, scheme, fingerprint, status, created_at) "
        "VALUES ('v1', 32, 2, 4, 2.0, 'xmark', :fingerprint, 'active', :now)",
        [{"fingerprint": "f" * 64, "now": now}],
    )
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES ('alice', 'user', 'active', '01', :now, :now)",
        [{"now": now}],
    )
    insert = (
        "INSERT INTO generations (request_id, user_id, key_version_id, model, prompt_tokens, completion_tokens, "
        "finish_reason, streamed, completion_sha256, created_at) "
        "VALUES (:rid, 1, 1, 'm', 1, 1, 'stop', false, :sha, :now)"
    )
    await _execute(url, insert, [{"rid": rid, "sha": "0" * 64, "now": now} for rid in ("a", "b", "a", "a")])
    await asyncio.to_thread(upgrade_database, url)
    rows = await _execute(url, "SELECT request_id, choice_index FROM generations ORDER BY id")
    assert [tuple(r) for r in rows] == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]
    with pytest.raises(Exception, match=r"(?i)unique"):
        await _execute(url, insert, [{"rid": "b", "sha": "0" * 64, "now": now}])
    _, diff = await _inspect(url)
    assert diff == [], f"models and migrations disagree: {diff}"


async def test_sqlite_choice_index_backfill(tmp_path: Path) -> None:
    await _choice_index_backfill(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")


@pytest.mark.postgres
async def test_postgres_choice_index_backfill(scratch_postgres: str) -> None:
    await _choice_index_backfill(scratch_postgres)


async def _trace_report_backfill(url: str) -> None:
    """0005 gives every existing trace a distinct report id (no signature); downgrading drops the
    report columns and keeps the traces."""
    await asyncio.to_thread(upgrade_database, url, "0004")
    now = datetime.now(UTC).replace(tzinfo=None)
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES ('auditor', 'auditor', 'active', '01', :now, :now)",
        [{"now": now}],
    )
    insert = (
        "INSERT INTO traces (requester_id, created_at, verdict, p_value, statistic, scored_tokens, decoder) "
        "VALUES (1, :now, :verdict, 0.5, 1.0, 10, 'counting')"
    )
    await _execute(url, insert, [{"now": now, "verdict": v} for v in ("watermarked", "not_watermarked", "watermarked")])
    await asyncio.to_thread(upgrade_database, url)
    rows = await _execute(url, "SELECT report_id, signature, text_sha256 FROM traces ORDER BY id")
    ids = [r[0] for r in rows]
    assert len(set(ids)) == 3 and all(i.startswith("trc_") and len(i) == 28 for i in ids)
    assert [tuple(r[1:]) for r in rows] == [(None, None)] * 3  # never signed after the fact
    with pytest.raises(Exception, match=r"(?i)unique"):
        await _execute(url, f"UPDATE traces SET report_id = '{ids[0]}' WHERE report_id = '{ids[1]}'")
    _, diff = await _inspect(url)
    assert diff == [], f"models and migrations disagree: {diff}"

    await asyncio.to_thread(downgrade_database, url, "0004")
    kept = await _execute(url, "SELECT verdict FROM traces ORDER BY id")
    assert [r[0] for r in kept] == ["watermarked", "not_watermarked", "watermarked"]
    with pytest.raises(Exception, match=r"(?i)report_id"):
        await _execute(url, "SELECT report_id FROM traces")
    await asyncio.to_thread(upgrade_database, url)
    again = await _execute(url, "SELECT report_id FROM traces")
    assert len({r[0] for r in again}) == 3


async def test_sqlite_trace_report_backfill(tmp_path: Path) -> None:
    await _trace_report_backfill(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}")


@pytest.mark.postgres
async def test_postgres_trace_report_backfill(scratch_postgres: str) -> None:
    await _trace_report_backfill(scratch_postgres)


_USAGE_FROM_RECORDS = {
    "sqlite": "date(created_at)",
    "postgresql": "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
}


async def _usage_daily(url: str) -> None:
    """0007 fills usage_daily from the records written before it; its triggers then add every
    record inserted (one by one and in a batch), and a duplicate refused by the unique key adds
    nothing: the table always equals the sum over the records."""
    await asyncio.to_thread(upgrade_database, url, "0006")
    noon = datetime(2026, 11, 20, 12, 0)
    await _execute(
        url,
        "INSERT INTO key_versions (name, bits, block_bits, num_keys, delta, scheme, fingerprint, status, created_at) "
        "VALUES ('v1', 32, 2, 4, 2.0, 'xmark', :fingerprint, 'active', :now)",
        [{"fingerprint": "f" * 64, "now": noon}],
    )
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES (:name, 'user', 'active', :mid, :now, :now)",
        [{"name": name, "mid": mid, "now": noon} for name, mid in (("alice", "01"), ("bob", "10"))],
    )
    insert = (
        "INSERT INTO generations (request_id, choice_index, user_id, key_version_id, model, prompt_tokens, "
        "completion_tokens, finish_reason, streamed, completion_sha256, created_at) "
        "VALUES (:rid, :choice, :user, 1, 'm', :prompt, :completion, 'stop', false, :sha, :at)"
    )

    def record(rid: str, choice: int, user: int, completion: int, at: datetime) -> dict[str, Any]:
        return {
            "rid": rid,
            "choice": choice,
            "user": user,
            "prompt": 7,
            "completion": completion,
            "sha": "0" * 64,
            "at": at,
        }

    late = noon.replace(hour=23, minute=59)
    before = [record("a", 0, 1, 5, noon), record("a", 1, 1, 6, noon), record("b", 0, 2, 3, late)]
    await _execute(url, insert, before)
    await asyncio.to_thread(upgrade_database, url)
    next_day = noon.replace(day=21, hour=0, minute=1)
    await _execute(url, insert, [record("c", 0, 1, 4, next_day)])  # one row
    await _execute(url, insert, [record("d", 0, 2, 2, late), record("d", 1, 2, 9, late), record("e", 0, 1, 1, noon)])
    with pytest.raises(Exception, match=r"(?i)unique"):
        await _execute(url, insert, [record("a", 0, 1, 100, noon)])  # a retried write: refused, adds nothing
    dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
    expected = await _execute(
        url,
        f"SELECT user_id, {_USAGE_FROM_RECORDS[dialect]} AS day, "
        "sum(CASE WHEN choice_index = 0 THEN 1 ELSE 0 END), count(*), "
        "sum(CASE WHEN choice_index = 0 THEN prompt_tokens ELSE 0 END), sum(completion_tokens) "
        "FROM generations GROUP BY 1, 2 ORDER BY 1, 2",
    )
    kept = await _execute(
        url,
        "SELECT user_id, day, requests, completions, prompt_tokens, completion_tokens FROM usage_daily ORDER BY 1, 2",
    )
    assert [tuple(r) for r in kept] == [tuple(r) for r in expected]
    assert [tuple(r) for r in kept] == [
        (1, "2026-11-20", 2, 3, 14, 12),
        (1, "2026-11-21", 1, 1, 7, 4),
        (2, "2026-11-20", 2, 3, 14, 14),
    ]
    days = await _execute(url, "SELECT day, users FROM usage_day_totals ORDER BY day")
    assert [tuple(r) for r in days] == [("2026-11-20", 2), ("2026-11-21", 1)]
    await _execute(url, "DELETE FROM usage_daily WHERE user_id = 2")  # (by hand: users are never deleted)
    days = await _execute(url, "SELECT day, users FROM usage_day_totals ORDER BY day")
    assert [tuple(r) for r in days] == [("2026-11-20", 1), ("2026-11-21", 1)]
    _, diff = await _inspect(url)
    assert diff == [], f"models and migrations disagree: {diff}"
    await asyncio.to_thread(downgrade_database, url, "0006")
    await _execute(url, insert, [record("f", 0, 1, 1, noon)])  # no trigger left behind
    await asyncio.to_thread(upgrade_database, url)
    again = await _execute(url, "SELECT sum(completions) FROM usage_daily")
    assert again[0][0] == 8
    days = await _execute(url, "SELECT day, users FROM usage_day_totals ORDER BY day")
    assert [tuple(r) for r in days] == [("2026-11-20", 2), ("2026-11-21", 1)]


async def test_sqlite_usage_daily(tmp_path: Path) -> None:
    await _usage_daily(f"sqlite+aiosqlite:///{tmp_path / 'u.db'}")


@pytest.mark.postgres
async def test_postgres_usage_daily(scratch_postgres: str) -> None:
    await _usage_daily(scratch_postgres)


async def _registry_audit_head(url: str) -> None:
    """0012 starts the registry's audit trail empty: one head row at seq 0 with the genesis hash,
    and no second head row can be added; downgrading drops both tables."""
    await asyncio.to_thread(upgrade_database, url, "0012")
    rows = await _execute(url, "SELECT id, seq, entry_hash FROM registry_audit_head")
    assert [tuple(r) for r in rows] == [(1, 0, "0" * 64)]
    assert await _execute(url, "SELECT seq FROM registry_audit") == []
    with pytest.raises(Exception, match=r"(?i)check|constraint"):
        await _execute(url, "INSERT INTO registry_audit_head (id, seq, entry_hash) VALUES (2, 0, 'x')")
    await asyncio.to_thread(downgrade_database, url, "0011")
    tables, _ = await _inspect(url)
    assert not tables & {"registry_audit", "registry_audit_head"}
    await asyncio.to_thread(upgrade_database, url)


async def test_sqlite_registry_audit_head(tmp_path: Path) -> None:
    await _registry_audit_head(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")


@pytest.mark.postgres
async def test_postgres_registry_audit_head(scratch_postgres: str) -> None:
    await _registry_audit_head(scratch_postgres)


async def _end_users_keep_the_triggers(url: str) -> None:
    """0013 adds the end-user columns without losing generations' triggers (usage, postings), and
    its downgrade drops them the same way."""
    await asyncio.to_thread(upgrade_database, url, "0012")
    triggers = "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'generations'"
    before = (await _execute(url, triggers))[0][0]
    assert before > 0
    await asyncio.to_thread(upgrade_database, url, "0013")
    assert (await _execute(url, triggers))[0][0] == before
    columns = {row[1] for row in await _execute(url, "PRAGMA table_info(generations)")}
    assert "end_user_id" in columns
    await asyncio.to_thread(downgrade_database, url, "0012")
    assert (await _execute(url, triggers))[0][0] == before
    assert "end_user_id" not in {row[1] for row in await _execute(url, "PRAGMA table_info(generations)")}


async def test_sqlite_end_users_keep_the_generation_triggers(tmp_path: Path) -> None:
    await _end_users_keep_the_triggers(f"sqlite+aiosqlite:///{tmp_path / 'e.db'}")


async def _end_user_limits(url: str) -> None:
    """0014 adds the end-user limit columns (NULL: the next level's value) and the usage index;
    its downgrade drops them and keeps the rows (and, on SQLite, generations' triggers)."""
    await asyncio.to_thread(upgrade_database, url, "0013")
    now = datetime.now(UTC).replace(tzinfo=None)
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES ('platform', 'user', 'active', '01', :now, :now)",
        [{"now": now}],
    )
    await _execute(
        url,
        "INSERT INTO end_users (user_id, identifier, status, created_at, last_seen_at) "
        "VALUES (1, 'eu', 'active', :now, :now)",
        [{"now": now}],
    )
    sqlite = url.startswith("sqlite")
    triggers = "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'generations'"
    before = (await _execute(url, triggers))[0][0] if sqlite else None
    await asyncio.to_thread(upgrade_database, url, "0014")
    rows = await _execute(
        url,
        "SELECT end_users_max, end_users_new_per_minute, end_user_requests_per_minute, end_user_tokens_per_minute "
        "FROM users",
    )
    assert [tuple(r) for r in rows] == [(None, None, None, None)]
    rows = await _execute(url, "SELECT identifier, requests_per_minute, tokens_per_minute FROM end_users")
    assert [tuple(r) for r in rows] == [("eu", None, None)]

    def indexes(connection: Connection) -> set[str]:
        return {index["name"] for index in inspect(connection).get_indexes("generations") if index["name"]}

    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            assert "ix_generations_end_user_id_created_at" in await connection.run_sync(indexes)
        if sqlite:
            assert (await _execute(url, triggers))[0][0] == before
        await asyncio.to_thread(downgrade_database, url, "0013")
        async with engine.connect() as connection:
            assert "ix_generations_end_user_id_created_at" not in await connection.run_sync(indexes)
            columns = await connection.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns("users")})
            assert not columns & {"end_users_max", "end_user_requests_per_minute"}
            columns = await connection.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns("end_users")})
            assert "requests_per_minute" not in columns
    finally:
        await engine.dispose()
    assert [tuple(r) for r in await _execute(url, "SELECT identifier FROM end_users")] == [("eu",)]
    if sqlite:
        assert (await _execute(url, triggers))[0][0] == before
    await asyncio.to_thread(upgrade_database, url)


async def test_sqlite_end_user_limits(tmp_path: Path) -> None:
    await _end_user_limits(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}")


@pytest.mark.postgres
async def test_postgres_end_user_limits(scratch_postgres: str) -> None:
    await _end_user_limits(scratch_postgres)


async def _end_user_tallies(url: str) -> None:
    """0015 fills ``end_user_tallies`` with each account's end users (deleted ones included; an
    account without any gets no row); its downgrade drops the table and keeps the end users."""
    await asyncio.to_thread(upgrade_database, url, "0014")
    now = datetime.now(UTC).replace(tzinfo=None)
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES (:name, 'user', 'active', :id, :now, :now)",
        [{"name": name, "id": message_id, "now": now} for name, message_id in (("a", "01"), ("b", "10"), ("c", "11"))],
    )
    await _execute(
        url,
        "INSERT INTO end_users (user_id, identifier, status, created_at, last_seen_at) "
        "VALUES (:user_id, :identifier, :status, :now, :now)",
        [
            {"user_id": user_id, "identifier": f"eu-{i}", "status": "deleted" if i == 0 else "active", "now": now}
            for user_id, count in ((1, 3), (2, 1))
            for i in range(count)
        ],
    )
    await asyncio.to_thread(upgrade_database, url, "0015")
    rows = await _execute(url, "SELECT user_id, total FROM end_user_tallies ORDER BY user_id")
    assert [tuple(r) for r in rows] == [(1, 3), (2, 1)]
    await asyncio.to_thread(downgrade_database, url, "0014")
    assert "end_user_tallies" not in (await _inspect(url))[0]
    assert len(await _execute(url, "SELECT id FROM end_users")) == 4
    await asyncio.to_thread(upgrade_database, url)


async def test_sqlite_end_user_tallies(tmp_path: Path) -> None:
    await _end_user_tallies(f"sqlite+aiosqlite:///{tmp_path / 't.db'}")


@pytest.mark.postgres
async def test_postgres_end_user_tallies(scratch_postgres: str) -> None:
    await _end_user_tallies(scratch_postgres)


async def _end_user_reserve(url: str) -> None:
    """0016 lets a slot row (no identifier; reserved, void or merged into an end user) in beside the
    end users, which keep their rows; its downgrade refuses while a slot row holds message IDs, and
    goes through once none does."""
    await asyncio.to_thread(upgrade_database, url, "0015")
    now = datetime.now(UTC).replace(tzinfo=None)
    await _execute(
        url,
        "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
        "VALUES ('a', 'user', 'active', '01', :now, :now)",
        [{"now": now}],
    )
    insert = (
        "INSERT INTO end_users (user_id, identifier, status, created_at, last_seen_at) "
        "VALUES (1, :identifier, :status, :now, :now)"
    )
    await _execute(url, insert, [{"identifier": "eu-0", "status": "active", "now": now}])
    with pytest.raises(IntegrityError):  # before 0016: no slot
        await _execute(url, insert, [{"identifier": None, "status": "reserved", "now": now}])
    await asyncio.to_thread(upgrade_database, url, "0016")
    await _execute(url, insert, [{"identifier": None, "status": s, "now": now} for s in ("reserved", "void")])
    await _execute(url, "UPDATE end_users SET status = 'merged', merged_into = 1 WHERE status = 'void'")
    with pytest.raises(IntegrityError):
        await _execute(url, insert, [{"identifier": None, "status": "lost", "now": now}])
    if url.startswith("postgresql"):  # this bare SQLite connection does not enforce foreign keys
        with pytest.raises(IntegrityError):  # merged into an end user that does not exist
            await _execute(url, "UPDATE end_users SET merged_into = 99 WHERE status = 'merged'")
    rows = await _execute(url, "SELECT identifier, status, merged_into FROM end_users ORDER BY id")
    assert [tuple(r) for r in rows] == [("eu-0", "active", None), (None, "reserved", None), (None, "merged", 1)]
    with pytest.raises(RuntimeError, match="2 end-user slot rows"):
        await asyncio.to_thread(downgrade_database, url, "0015")
    await _execute(url, "DELETE FROM end_users WHERE identifier IS NULL")
    await asyncio.to_thread(downgrade_database, url, "0015")
    assert [tuple(r) for r in await _execute(url, "SELECT identifier FROM end_users")] == [("eu-0",)]
    await asyncio.to_thread(upgrade_database, url)


async def test_sqlite_end_user_reserve(tmp_path: Path) -> None:
    await _end_user_reserve(f"sqlite+aiosqlite:///{tmp_path / 'r.db'}")


@pytest.mark.postgres
async def test_postgres_end_user_reserve(scratch_postgres: str) -> None:
    await _end_user_reserve(scratch_postgres)
