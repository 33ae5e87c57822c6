"""Locks that make the "last one" guards (last active admin, last active key version) race-free.

A guard counts a set (the active admins, the active key versions) and refuses a change that would
leave it empty. Counting and changing in one transaction is not enough under concurrency: two
admins disabling each other both count two and both commit, leaving none. So every change that can
shrink a guarded set first takes that set's lock, held until its transaction ends, and only then
reads the row and counts; a second change waits, and its count (a new statement, a new snapshot
under READ COMMITTED) sees the first one committed.

* PostgreSQL: a transaction-level advisory lock per set (``pg_advisory_xact_lock``). Unlike
  ``SELECT ... FOR UPDATE`` over the counted rows it also covers rows that are about to join or
  leave the set, and it cannot deadlock against a row lock taken later in the same change.
* SQLite: the database's single write lock, taken by a write that changes nothing. The driver opens
  the transaction at that write, so the count that follows reads the newest committed state and no
  other writer (another connection or process) can commit until this transaction ends.

Take the lock before reading the row that is changed (a row lock taken first could deadlock with a
change waiting for the guard while holding that row).
"""

from __future__ import annotations

from enum import Enum

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession


class Guard(Enum):
    """A guarded set; the value is its advisory-lock key (any fixed 64-bit number, unique per set)."""

    ACTIVE_ADMINS = 0x786D61726B_0001  # "xmark" · 1
    ACTIVE_KEY_VERSIONS = 0x786D61726B_0002  # "xmark" · 2


# SQLite: the table whose no-op update takes the write lock (any table would do)
_SQLITE_TABLE = {Guard.ACTIVE_ADMINS: "users", Guard.ACTIVE_KEY_VERSIONS: "key_versions"}


async def lock_guarded_set(session: AsyncSession, guard: Guard) -> None:
    """Hold ``guard``'s lock until the session's transaction ends (commit or rollback)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": guard.value})
    elif dialect == "sqlite":
        table = _SQLITE_TABLE[guard]
        await session.execute(text(f"UPDATE {table} SET id = id WHERE 1 = 0"))
