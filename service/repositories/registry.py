"""Read-only view of the message-ID registry: the message IDs of one length with their owners
(the users table, tombstones included)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import MessageId, User


@dataclass(frozen=True)
class RegistryEntry:
    user_id: int
    name: str
    status: str
    message_id: str


@dataclass(frozen=True)
class RegistryFingerprint:
    """Cheap summary that changes whenever a user is added, changed or deleted, or gets an ID of the length."""

    count: int
    max_id: int | None
    max_updated_at: datetime | None
    ids: int = 0
    max_message_id_row: int | None = None


class RegistryRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def fingerprint(self, bits: int, block_bits: int) -> RegistryFingerprint:
        of_length = (MessageId.bits == bits, MessageId.block_bits == block_bits)
        ids = select(func.count(MessageId.id)).where(*of_length).scalar_subquery()
        max_row = select(func.max(MessageId.id)).where(*of_length).scalar_subquery()
        stmt = select(func.count(User.id), func.max(User.id), func.max(User.updated_at), ids, max_row)
        count, max_id, max_updated, id_count, max_id_row = (await self._session.execute(stmt)).one()
        return RegistryFingerprint(int(count or 0), max_id, max_updated, int(id_count or 0), max_id_row)

    async def entries(self, bits: int, block_bits: int) -> Sequence[RegistryEntry]:
        """Every registered message ID of this length with its owner, deleted users included."""
        stmt = (
            select(User.id, User.name, User.status, MessageId.message_id)
            .join(MessageId, MessageId.user_id == User.id)
            .where(MessageId.bits == bits, MessageId.block_bits == block_bits)
            .order_by(User.id)
        )
        rows = (await self._session.execute(stmt)).all()
        return [RegistryEntry(row.id, row.name, row.status, row.message_id) for row in rows]
