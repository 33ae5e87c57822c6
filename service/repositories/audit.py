"""Queries over the registry's audit trail: the head row, appends, pages and the chain in order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, insert, inspect, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import RegistryAuditEntry, RegistryAuditHead

HEAD_ID = 1


@dataclass(frozen=True)
class AuditFilters:
    action: str | None = None
    target_type: str | None = None
    target_id: str | None = None
    actor_user_id: int | None = None
    since: datetime | None = None
    until: datetime | None = None


class AuditRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def advance_head(self) -> tuple[int, str] | None:
        """Take the head row for this unit of work and move it one entry on: the new entry's
        sequence number and the previous entry's hash (None when the head row is gone).

        One UPDATE both reads and locks the row: a concurrent append waits here until this unit
        of work ends (PostgreSQL's row lock; on SQLite it is the database's write lock), then reads
        the head this one committed, so no two entries ever get the same number or predecessor.
        """
        stmt = (
            update(RegistryAuditHead)
            .where(RegistryAuditHead.id == HEAD_ID)
            .values(seq=RegistryAuditHead.seq + 1)
            .returning(RegistryAuditHead.seq, RegistryAuditHead.entry_hash)
            .execution_options(synchronize_session=False)
        )
        row = (await self._session.execute(stmt)).first()
        return None if row is None else (int(row[0]), str(row[1]))

    async def append(self, entry: RegistryAuditEntry) -> None:
        """Insert the entry and point the head at it (after :meth:`advance_head`, same unit of work)."""
        # a Core INSERT of the entry's columns: one cached statement, without the ORM's flush
        values = {attr.key: getattr(entry, attr.key) for attr in inspect(RegistryAuditEntry).column_attrs}
        await self._session.execute(insert(RegistryAuditEntry), [values])
        await self._session.execute(
            update(RegistryAuditHead)
            .where(RegistryAuditHead.id == HEAD_ID)
            .values(entry_hash=entry.entry_hash)
            .execution_options(synchronize_session=False)
        )

    async def head(self) -> tuple[int, str] | None:
        """The head's sequence number and hash as committed (None when the row is gone)."""
        row = (
            await self._session.execute(
                select(RegistryAuditHead.seq, RegistryAuditHead.entry_hash).where(RegistryAuditHead.id == HEAD_ID)
            )
        ).first()
        return None if row is None else (int(row[0]), str(row[1]))

    async def page(
        self, filters: AuditFilters, *, after_seq: int | None, limit: int, newest_first: bool
    ) -> Sequence[RegistryAuditEntry]:
        """Up to ``limit`` matching entries in sequence order (``newest_first``: descending), after
        ``after_seq`` in that order (keyset paging: read from the primary key's index however deep)."""
        conditions: list[ColumnElement[bool]] = []
        if after_seq is not None:
            seq = RegistryAuditEntry.seq
            conditions.append(seq < after_seq if newest_first else seq > after_seq)
        if filters.action is not None:
            conditions.append(RegistryAuditEntry.action == filters.action)
        if filters.target_type is not None:
            conditions.append(RegistryAuditEntry.target_type == filters.target_type)
        if filters.target_id is not None:
            conditions.append(RegistryAuditEntry.target_id == filters.target_id)
        if filters.actor_user_id is not None:
            conditions.append(RegistryAuditEntry.actor_user_id == filters.actor_user_id)
        if filters.since is not None:
            conditions.append(RegistryAuditEntry.created_at >= filters.since)
        if filters.until is not None:
            conditions.append(RegistryAuditEntry.created_at < filters.until)
        order = RegistryAuditEntry.seq.desc() if newest_first else RegistryAuditEntry.seq
        stmt = select(RegistryAuditEntry).where(*conditions).order_by(order).limit(limit)
        return (await self._session.scalars(stmt)).all()

    async def chain(self, *, after_seq: int, limit: int) -> Sequence[RegistryAuditEntry]:
        """The next ``limit`` entries after ``after_seq``, in sequence order (what a verifier reads)."""
        stmt = (
            select(RegistryAuditEntry)
            .where(RegistryAuditEntry.seq > after_seq)
            .order_by(RegistryAuditEntry.seq)
            .limit(limit)
        )
        return (await self._session.scalars(stmt)).all()
