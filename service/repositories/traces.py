"""Writes and counts over the traces table."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Trace


class TraceRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def add(self, trace: Trace) -> Trace:
        self._session.add(trace)
        await self._session.flush()
        return trace

    async def count(self) -> int:
        return int(await self._session.scalar(select(func.count()).select_from(Trace)) or 0)
