"""Alembic migrations: up, down and up again on SQLite and PostgreSQL; models match the schema."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.db import alembic_config, downgrade_database, upgrade_database
from service.models import Base

TABLES = {"users", "api_keys", "key_versions", "generations", "traces"}


async def _inspect(url: str) -> tuple[set[str], list[Any]]:
    engine = create_async_engine(url, poolclass=NullPool)

    def run(connection: Connection) -> tuple[set[str], list[Any]]:
        tables = set(inspect(connection).get_table_names())
        diff = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata)
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


async def test_the_test_database_is_at_head(migrated_database: str) -> None:
    engine = create_async_engine(migrated_database, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            version = await connection.scalar(text("SELECT version_num FROM alembic_version"))
    finally:
        await engine.dispose()
    assert version == ScriptDirectory.from_config(alembic_config(migrated_database)).get_current_head()
