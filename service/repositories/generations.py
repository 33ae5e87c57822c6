"""Writes and counts over the generations table."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation


class GenerationRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def add(self, generation: Generation) -> Generation:
        self._session.add(generation)
        await self._session.flush()
        return generation

    async def count(self, *, user_id: int | None = None) -> int:
        stmt = select(func.count()).select_from(Generation)
        if user_id is not None:
            stmt = stmt.where(Generation.user_id == user_id)
        return int(await self._session.scalar(stmt) or 0)
