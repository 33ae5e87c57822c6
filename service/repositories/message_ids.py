"""Queries over the message_ids table (one message ID per user and message length)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exists, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import EndUser, MessageId, User
from service.vocabulary import EndUserSlot


@dataclass(frozen=True)
class MissingUser:
    """A user without a message ID of some length, and the ID it was created with."""

    user_id: int
    created_with: str


class MessageIdRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def add_all(self, rows: Sequence[MessageId]) -> None:
        self._session.add_all(rows)
        await self._session.flush()

    async def of_user(self, user_id: int) -> Sequence[MessageId]:
        stmt = select(MessageId).where(MessageId.user_id == user_id).order_by(MessageId.bits, MessageId.block_bits)
        return (await self._session.scalars(stmt)).all()

    async def of_users(self, user_ids: Iterable[int]) -> dict[int, list[MessageId]]:
        """Every message ID of each of ``user_ids`` (shortest length first)."""
        ids = list(user_ids)
        found: dict[int, list[MessageId]] = {user_id: [] for user_id in ids}
        if not ids:
            return found
        stmt = (
            select(MessageId)
            .where(MessageId.user_id.in_(ids))
            .order_by(MessageId.user_id, MessageId.bits, MessageId.block_bits)
        )
        for row in (await self._session.scalars(stmt)).all():
            if row.user_id is not None:
                found[row.user_id].append(row)
        return found

    async def held(self, bits: int, block_bits: int) -> list[str]:
        """Every message ID of this length ever allocated, deleted users' and end users' included."""
        stmt = select(MessageId.message_id).where(MessageId.bits == bits, MessageId.block_bits == block_bits)
        return list((await self._session.scalars(stmt)).all())

    async def newest_row(self) -> int:
        """The largest message-ID row id (0 when none): at most the number of IDs ever allocated,
        read from the primary key's index."""
        return int(await self._session.scalar(select(func.max(MessageId.id))) or 0)

    async def existing(self, bits: int, block_bits: int) -> list[str]:
        """``held`` and ``created_with`` of one length in one statement: what a new ID of it is
        allocated against."""
        held = select(MessageId.message_id).where(MessageId.bits == bits, MessageId.block_bits == block_bits)
        created = select(User.message_id).where(func.length(User.message_id) == bits)
        return list((await self._session.scalars(held.union_all(created))).all())

    async def created_with(self, bits: int) -> list[str]:
        """Every ``users.message_id`` (the ID a user was created with) of ``bits`` bits."""
        stmt = select(User.message_id).where(func.length(User.message_id) == bits)
        return list((await self._session.scalars(stmt)).all())

    async def missing(self, bits: int, block_bits: int, *, limit: int) -> list[MissingUser]:
        """Up to ``limit`` users (deleted ones included), lowest id first, with no ID of this length."""
        has_one = exists().where(
            MessageId.user_id == User.id, MessageId.bits == bits, MessageId.block_bits == block_bits
        )
        stmt = select(User.id, User.message_id).where(~has_one).order_by(User.id).limit(limit)
        return [MissingUser(row.id, row.message_id) for row in (await self._session.execute(stmt)).all()]

    async def missing_end_users(self, bits: int, block_bits: int, *, limit: int) -> list[int]:
        """Up to ``limit`` end users (deleted ones included), lowest id first, with no ID of this length."""
        has_one = exists().where(
            MessageId.end_user_id == EndUser.id, MessageId.bits == bits, MessageId.block_bits == block_bits
        )
        # a reserved slot gets one too (a first sight may take it); void and merged rows never generate
        gone = EndUser.status.in_((EndUserSlot.VOID.value, EndUserSlot.MERGED.value))
        stmt = select(EndUser.id).where(~has_one, ~gone).order_by(EndUser.id).limit(limit)
        return list((await self._session.scalars(stmt)).all())

    async def insert_if_free(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert the rows that violate no unique constraint (``ON CONFLICT DO NOTHING``): a row
        whose user already has an ID of that length, or whose ID another user holds, is skipped.
        Returns how many were inserted. A row another transaction is inserting waits for it."""
        if not rows:
            return 0
        dialect = self._session.get_bind().dialect.name
        if dialect == "postgresql":
            stmt: Any = postgresql.insert(MessageId).on_conflict_do_nothing()
        elif dialect == "sqlite":
            stmt = sqlite.insert(MessageId).on_conflict_do_nothing()
        else:  # pragma: no cover - the gateway runs on PostgreSQL or SQLite only
            raise NotImplementedError(f"no INSERT … ON CONFLICT for {dialect}")
        # the rows as parameters of one cached statement (SQLAlchemy's "insertmanyvalues"), not
        # a statement compiled for these values
        result = await self._session.execute(stmt.returning(MessageId.id), [dict(row) for row in rows])
        return len(result.all())
