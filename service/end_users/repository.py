"""Queries over the end_users table, the end users' rows of message_ids and their generation records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, case, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import EndUser, EndUserTally, Generation, MessageId
from service.repositories.like import escape_like
from service.vocabulary import EndUserSlot, EndUserStatus

# an end user of its own (a slot row, ``EndUserSlot``, has no identifier): what every reader lists
IS_END_USER = EndUser.identifier.is_not(None)
# what an account's tally counts: its end users and its reserved slots (not the void or merged rows)
COUNTED = EndUser.status.not_in((EndUserSlot.VOID.value, EndUserSlot.MERGED.value))


@dataclass(frozen=True)
class FoundEndUser:
    """An end user as the request path reads it: the row and its message IDs."""

    row: EndUser
    message_ids: tuple[MessageId, ...]


def _insert(dialect: str) -> Any:
    if dialect == "postgresql":
        return postgresql.insert
    if dialect == "sqlite":
        return sqlite.insert
    raise NotImplementedError(f"no INSERT … ON CONFLICT for {dialect}")  # pragma: no cover


class EndUserRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session
        self._dialect = session.get_bind().dialect.name

    async def find(self, user_id: int, identifier: str) -> FoundEndUser | None:
        """The account's end user with ``identifier`` and its message IDs (one statement)."""
        stmt = (
            select(EndUser, MessageId)
            .outerjoin(MessageId, MessageId.end_user_id == EndUser.id)
            .where(EndUser.user_id == user_id, EndUser.identifier == identifier)
        )
        rows = (await self._session.execute(stmt)).all()
        if not rows:
            return None
        return FoundEndUser(rows[0][0], tuple(m for _, m in rows if m is not None))

    async def get(self, user_id: int, end_user_id: int, *, for_update: bool = False) -> EndUser | None:
        stmt = select(EndUser).where(EndUser.id == end_user_id, EndUser.user_id == user_id, IS_END_USER)
        if for_update:
            stmt = stmt.with_for_update()
        return (await self._session.execute(stmt)).scalar_one_or_none()

    async def count_one_more(self, user_id: int, more: int = 1) -> int:
        """Lock the account's tally (``end_user_tallies``) until the transaction ends and count one
        end user (or ``more``) more on it; the account's end users before these (deleted ones and
        reserved slots included).

        The lock decides the account's first sights one after the other (and the caps they check);
        the tally is one row however many end users the account has. An account without a row yet
        gets one from a count of its end users (once)."""
        add_one = (
            update(EndUserTally)
            .where(EndUserTally.user_id == user_id)
            .values(total=EndUserTally.total + more)
            .returning(EndUserTally.total)
            .execution_options(synchronize_session=False)
        )
        total = await self._session.scalar(add_one)
        if total is None:
            counted = (
                select(func.count()).select_from(EndUser).where(EndUser.user_id == user_id, COUNTED).scalar_subquery()
            )
            first = (
                _insert(self._dialect)(EndUserTally)
                .values(user_id=user_id, total=counted)
                .on_conflict_do_nothing(index_elements=["user_id"])
            )
            await self._session.execute(first)
            total = await self._session.scalar(add_one)
            assert total is not None
        return int(total) - more

    async def count_one_less(self, user_id: int, less: int = 1) -> None:
        """Take back ``count_one_more`` (the end user was there after all; slots given back)."""
        await self._session.execute(
            update(EndUserTally)
            .where(EndUserTally.user_id == user_id)
            .values(total=EndUserTally.total - less)
            .execution_options(synchronize_session=False)
        )

    async def count(self, user_id: int, *, since: datetime | None = None) -> int:
        """The account's end users (deleted ones and reserved slots included), or those created at or
        after ``since``."""
        filters: list[ColumnElement[bool]] = [EndUser.user_id == user_id, COUNTED]
        if since is not None:
            filters.append(EndUser.created_at >= since)
        return int(await self._session.scalar(select(func.count()).select_from(EndUser).where(*filters)) or 0)

    async def insert(self, user_id: int, identifier: str, now: datetime) -> int | None:
        """Insert the end user unless the account already has one with ``identifier`` (the unique
        constraint: a concurrent first sight won); its id, or None when it was there."""
        values = {
            "user_id": user_id,
            "identifier": identifier,
            "status": "active",
            "created_at": now,
            "last_seen_at": now,
        }
        stmt = (
            _insert(self._dialect)(EndUser)
            .values(values)
            .on_conflict_do_nothing(index_elements=["user_id", "identifier"])
            .returning(EndUser.id)
        )
        return await self._session.scalar(stmt)

    async def insert_slots(self, user_id: int, n: int, now: datetime) -> list[int]:
        """Insert ``n`` reserved slots of the account (``EndUserSlot.RESERVED``: no identifier); their ids."""
        values = [
            {
                "user_id": user_id,
                "identifier": None,
                "status": EndUserSlot.RESERVED.value,
                "created_at": now,
                "last_seen_at": now,
            }
            for _ in range(n)
        ]
        stmt = _insert(self._dialect)(EndUser).returning(EndUser.id, sort_by_parameter_order=True)
        return list((await self._session.scalars(stmt, values)).all())

    async def claim(self, slot_id: int, identifier: str, now: datetime) -> bool:
        """Make the reserved slot the end user named ``identifier`` (first seen ``now``); False when
        it is no longer reserved. Raises ``IntegrityError`` when the account already has an end user
        of that identifier (another replica's first sight won: ``merge``)."""
        stmt = (
            update(EndUser)
            .where(EndUser.id == slot_id, EndUser.status == EndUserSlot.RESERVED.value)
            .values(identifier=identifier, status=EndUserStatus.ACTIVE.value, created_at=now, last_seen_at=now)
            .returning(EndUser.id)
            .execution_options(synchronize_session=False)
        )
        return await self._session.scalar(stmt) is not None

    async def merge(self, slot_id: int, into: int) -> bool:
        """Turn the reserved slot into a merged row naming the end user ``into``; False when it is
        no longer reserved."""
        stmt = (
            update(EndUser)
            .where(EndUser.id == slot_id, EndUser.status == EndUserSlot.RESERVED.value)
            .values(status=EndUserSlot.MERGED.value, merged_into=into)
            .returning(EndUser.id)
            .execution_options(synchronize_session=False)
        )
        return await self._session.scalar(stmt) is not None

    async def void(self, user_id: int, slot_ids: Sequence[int]) -> int:
        """Give the account's reserved slots back unused (``EndUserSlot.VOID``: their message IDs
        stay reserved) and off its tally; how many were still reserved."""
        return await self._void_where(user_id, EndUser.id.in_(list(slot_ids)))

    async def void_stale(self, user_id: int, renewed_before: datetime) -> int:
        """``void`` the account's slots still reserved and last renewed (``last_seen_at``) before
        ``renewed_before``: those a process that stopped without giving them back (killed) left
        behind, past any holder's lease (``service.end_users.reserve.STALE_SLOT_S``). How many."""
        return await self._void_where(user_id, EndUser.last_seen_at < renewed_before)

    async def renew(self, slot_ids: Sequence[int], now: datetime) -> None:
        """Mark the reserved slots ``slot_ids`` as still held by their process (``last_seen_at``)."""
        await self._session.execute(
            update(EndUser)
            .where(EndUser.id.in_(list(slot_ids)), EndUser.status == EndUserSlot.RESERVED.value)
            .values(last_seen_at=now)
            .execution_options(synchronize_session=False)
        )

    async def _void_where(self, user_id: int, which: ColumnElement[bool]) -> int:
        stmt = (
            update(EndUser)
            .where(which, EndUser.user_id == user_id, EndUser.status == EndUserSlot.RESERVED.value)
            .values(status=EndUserSlot.VOID.value)
            .returning(EndUser.id)
            .execution_options(synchronize_session=False)
        )
        voided = len((await self._session.scalars(stmt)).all())
        if voided:
            await self.count_one_less(user_id, voided)
        return voided

    async def renumber_message_ids(self, end_user_id: int) -> None:
        """Write the end user's message ID rows again, the same values under new row ids: the trace
        registry's snapshots, which read the rows after the newest they hold, then read them with
        the end user a claimed slot has become."""
        rows = (
            await self._session.execute(
                delete(MessageId)
                .where(MessageId.end_user_id == end_user_id)
                .returning(MessageId.bits, MessageId.block_bits, MessageId.message_id, MessageId.created_at)
                .execution_options(synchronize_session=False)
            )
        ).all()
        if rows:
            await self._session.execute(
                _insert(self._dialect)(MessageId),
                [
                    {
                        "end_user_id": end_user_id,
                        "bits": r.bits,
                        "block_bits": r.block_bits,
                        "message_id": r.message_id,
                        "created_at": r.created_at,
                    }
                    for r in rows
                ],
            )

    async def add_message_ids(self, rows: Sequence[MessageId]) -> None:
        self._session.add_all(rows)
        await self._session.flush()

    async def seen(self, end_user_id: int, now: datetime) -> None:
        await self._session.execute(update(EndUser).where(EndUser.id == end_user_id).values(last_seen_at=now))

    async def page(
        self, user_id: int, *, limit: int, offset: int, q: str | None = None, status: str | None = None
    ) -> tuple[Sequence[EndUser], int]:
        """A page of the account's end users by id, and how many match (``q``: a case-insensitive
        substring of the identifier)."""
        filters: list[ColumnElement[bool]] = [EndUser.user_id == user_id, IS_END_USER]
        if q:
            filters.append(EndUser.identifier.ilike(f"%{escape_like(q)}%", escape="\\"))
        if status is not None:
            filters.append(EndUser.status == status)
        rows = await self._session.scalars(
            select(EndUser).where(*filters).order_by(EndUser.id).limit(limit).offset(offset)
        )
        total = await self._session.scalar(select(func.count()).select_from(EndUser).where(*filters))
        return rows.all(), int(total or 0)

    async def message_ids_of(self, end_user_ids: Sequence[int]) -> dict[int, list[MessageId]]:
        found: dict[int, list[MessageId]] = {i: [] for i in end_user_ids}
        if not end_user_ids:
            return found
        stmt = (
            select(MessageId)
            .where(MessageId.end_user_id.in_(list(end_user_ids)))
            .order_by(MessageId.end_user_id, MessageId.bits, MessageId.block_bits)
        )
        for row in (await self._session.scalars(stmt)).all():
            if row.end_user_id is not None:
                found[row.end_user_id].append(row)
        return found

    async def usage(self, end_user_ids: Sequence[int], since: datetime) -> dict[int, tuple[int, int]]:
        """Per end user: the generation requests recorded at or after ``since`` and their tokens
        (prompt tokens once per request, plus every choice's completion tokens); one statement on
        ``ix_generations_end_user_id_created_at``."""
        found = dict.fromkeys(end_user_ids, (0, 0))
        if not end_user_ids:
            return found
        first = Generation.choice_index == 0
        stmt = (
            select(
                Generation.end_user_id,
                func.sum(case((first, 1), else_=0)),
                func.sum(case((first, Generation.prompt_tokens), else_=0) + Generation.completion_tokens),
            )
            .where(Generation.end_user_id.in_(list(end_user_ids)), Generation.created_at >= since)
            .group_by(Generation.end_user_id)
        )
        for end_user_id, requests, tokens in (await self._session.execute(stmt)).all():
            found[end_user_id] = (int(requests or 0), int(tokens or 0))
        return found

    async def flush(self) -> None:
        await self._session.flush()
