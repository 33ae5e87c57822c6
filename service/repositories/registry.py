"""Read-only view of the message-ID registry (the users table, tombstones included)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import User


@dataclass(frozen=True)
class RegistryEntry:
    user_id: int
    name: str
    status: str
    message_id: str


@dataclass(frozen=True)
class RegistryFingerprint:
    """Cheap summary that changes whenever a user is added, changed or deleted."""

    count: int
    max_id: int | None
    max_updated_at: datetime | None


class RegistryRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def fingerprint(self) -> RegistryFingerprint:
        stmt = select(func.count(User.id), func.max(User.id), func.max(User.updated_at))
        count, max_id, max_updated = (await self._session.execute(stmt)).one()
        return RegistryFingerprint(int(count or 0), max_id, max_updated)

    async def entries(self) -> Sequence[RegistryEntry]:
        """Every registered message ID with its owner, deleted users included."""
        stmt = select(User.id, User.name, User.status, User.message_id).order_by(User.id)
        rows = (await self._session.execute(stmt)).all()
        return [RegistryEntry(row.id, row.name, row.status, row.message_id) for row in rows]
