"""Service-test helpers on top of tests/conftest.py."""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.config import Settings, parse_secret_entries
from service.db import create_engine, upgrade_database
from service.models import KeyVersion
from xmark_core import allocate_message
from xmark_core.encoders import KeyVersionSpec, encoder_keys

# the seed of the message IDs of ``seeded_message_ids``
MESSAGE_ID_SEED = 20261202


@asynccontextmanager
async def own_database(settings: Settings, prefix: str) -> AsyncIterator[str]:
    """A database beside the test database, created, migrated and dropped here (for a server in
    another thread or process, whose rows are committed for real)."""
    url = sibling_url(settings.database_url, f"{prefix}_{uuid.uuid4().hex[:8]}")
    await create_database(url)
    try:
        await asyncio.to_thread(upgrade_database, url)
        yield url
    finally:
        await drop_database(url)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def scratch_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A migrated database of the test's own, committed for real: a SQLite file, or a throw-away
    PostgreSQL database beside the test database (``indirect`` parametrization picks one)."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'scratch.db'}"
        await asyncio.to_thread(upgrade_database, url)
        yield url
        return
    settings = request.getfixturevalue("settings")
    url = sibling_url(settings.database_url, f"xmark_scratch_{uuid.uuid4().hex[:10]}")
    try:
        await create_database(url)
        await asyncio.to_thread(upgrade_database, url)
        yield url
    finally:
        await drop_database(url)


@pytest.fixture
def seeded_message_ids(monkeypatch: pytest.MonkeyPatch) -> random.Random:
    """The users this test creates get their message IDs from a generator seeded here instead of
    the system's randomness (the allocation rule is the product's: ``allocate_message`` with its
    ``rng``), so a test whose verdict depends on the IDs (a watermark written for one, detected and
    attributed) gives the same outcome on every run. Modules whose tests are statistical in that
    way use it (``pytest.mark.usefixtures``)."""
    import service.services.users

    rng = random.Random(MESSAGE_ID_SEED)
    monkeypatch.setattr(service.services.users, "allocate_message", functools.partial(allocate_message, rng=rng))
    return rng


@pytest.fixture
def planted_secrets(settings: Settings) -> list[str]:
    """The configured secrets of the test app (what must never leave the process)."""
    assert settings.watermark_secrets is not None and settings.api_key_pepper is not None
    entries = parse_secret_entries(settings.watermark_secrets.get_secret_value(), source="test")
    return [*(v.decode() for v in entries.values()), settings.api_key_pepper.get_secret_value()]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh file-backed SQLite database URL (embedded mode)."""
    return f"sqlite+aiosqlite:///{tmp_path / 'var' / 'xmark.db'}"


@pytest.fixture
async def admin(settings: Settings, migrated_database: str) -> AsyncIterator[AsyncEngine]:
    """An engine of its own on the test database, outside the test's transaction (DDL, inspection)."""
    engine = create_async_engine(settings.database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
async def engine(settings: Settings, migrated_database: str) -> AsyncIterator[AsyncEngine]:
    """The gateway's own engine (as ``create_engine`` configures it) on the test database."""
    engine = create_engine(settings)
    try:
        yield engine
    finally:
        await engine.dispose()


@asynccontextmanager
async def scratch_table(admin: AsyncEngine, table: Table) -> AsyncIterator[Table]:
    """``table`` created on the test database for one test, dropped afterwards."""
    async with admin.begin() as connection:
        await connection.run_sync(table.create)
    try:
        yield table
    finally:
        async with admin.begin() as connection:
            await connection.run_sync(table.drop)


@pytest.fixture
async def ready(app: Any) -> None:
    """The app's local model has loaded."""
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"


@pytest.fixture
def fresh_registry(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test rolls back its users; make the registry cache look at the table on every trace
    (modules that trace use it with ``pytest.mark.usefixtures``)."""
    monkeypatch.setattr(app.state.resources.registry_cache, "check_interval", 0.0)


async def make_only_active_version(db_session: AsyncSession, name: str, secret: bytes, spec: KeyVersionSpec) -> None:
    """The configured secret ``name`` becomes the only active key version, with ``spec``'s encoders:
    its row is changed, or added, inside the test's transaction, and every other version is retired
    there (all rolled back with the test). The caller refreshes the keyring."""
    now = datetime.now(UTC)
    await db_session.execute(
        update(KeyVersion).where(KeyVersion.name != name).values(status="retired", retired_at=now),
        execution_options={"synchronize_session": False},
    )
    db_session.expire_all()
    row = (await db_session.scalars(select(KeyVersion).where(KeyVersion.name == name))).one_or_none()
    if row is None:
        row = KeyVersion(name=name, created_at=now)
        db_session.add(row)
    primary, *companion_key = encoder_keys(secret, spec)
    p = spec.primary
    row.bits, row.block_bits, row.num_keys, row.delta, row.scheme = p.bits, p.block_bits, p.num_keys, p.delta, p.scheme
    row.min_entropy, row.salts, row.fingerprint = p.min_entropy, p.salts, primary.fingerprint
    c = spec.companion
    row.companion_scheme = None if c is None else c.scheme
    row.companion_block_bits = None if c is None else c.block_bits
    row.companion_num_keys = None if c is None else c.num_keys
    row.companion_delta = None if c is None else c.delta
    row.companion_min_entropy = None if c is None else c.min_entropy
    row.companion_fingerprint = companion_key[0].fingerprint if companion_key else None
    row.status, row.activated_at, row.retired_at = "active", now, None
    await db_session.flush()
