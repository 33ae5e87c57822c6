"""Queries over the users table."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import User
from service.repositories.like import escape_like
from service.vocabulary import Role, UserStatus


class UserRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def add(self, user: User) -> User:
        self._session.add(user)
        await self._session.flush()
        return user

    async def get(self, user_id: int) -> User | None:
        return await self._session.get(User, user_id)

    async def get_for_update(self, user_id: int) -> User | None:
        stmt = select(User).where(User.id == user_id).with_for_update()
        return (await self._session.execute(stmt)).scalar_one_or_none()

    async def page(
        self,
        *,
        limit: int,
        offset: int,
        status: str | None = None,
        role: str | None = None,
        name_contains: str | None = None,
        after_id: int | None = None,
    ) -> tuple[Sequence[User], int]:
        """A page of the matching users by id, and how many match. ``after_id`` (keyset paging: the
        last id of the previous page) starts after that user, read from the primary key's index
        however deep the page; the count is then of the matches after it."""
        filters: list[ColumnElement[bool]] = []
        if after_id is not None:
            filters.append(User.id > after_id)
        if name_contains:
            # case-insensitive substring; the text's own % and _ match themselves
            filters.append(User.name.ilike(f"%{escape_like(name_contains)}%", escape="\\"))
        if status is not None:
            filters.append(User.status == status)
        if role is not None:
            filters.append(User.role == role)
        rows = await self._session.scalars(select(User).where(*filters).order_by(User.id).limit(limit).offset(offset))
        total = await self._session.scalar(select(func.count()).select_from(User).where(*filters))
        return rows.all(), int(total or 0)

    async def all_message_ids(self) -> list[str]:
        """Every message ID ever allocated, tombstones included."""
        return list((await self._session.scalars(select(User.message_id))).all())

    async def count_active_admins(self) -> int:
        stmt = select(func.count()).select_from(User).where(User.role == Role.ADMIN, User.status == UserStatus.ACTIVE)
        return int(await self._session.scalar(stmt) or 0)

    async def flush(self) -> None:
        await self._session.flush()
