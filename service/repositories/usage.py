"""Usage per user per UTC day (SQLite and PostgreSQL), read from ``usage_daily``, which triggers on the
generations table keep (migration 0007) and those on the embedding records (migration 0011)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import UsageDaily, UsageDayTotals, User


@dataclass(frozen=True)
class UsageRow:
    user_id: int
    user_name: str
    day: str
    requests: int
    completions: int
    prompt_tokens: int
    completion_tokens: int
    embedding_requests: int = 0
    embedding_tokens: int = 0


class UsageRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def per_user_day(
        self, *, since: datetime, user_id: int | None, limit: int, offset: int
    ) -> tuple[Sequence[UsageRow], int]:
        """Rows of ``since``'s UTC day and later, by (user, UTC day), newest day first.

        Read from ``usage_daily``, which the database keeps as records are inserted (migration
        0007): one row per user and day, whatever the number of records. A request's prompt is
        counted once (the record of its choice 0); completions and completion tokens count every
        record."""
        since_day = since.astimezone(UTC).strftime("%Y-%m-%d")
        filters = [UsageDaily.day >= since_day]
        if user_id is not None:
            filters.append(UsageDaily.user_id == user_id)
        stmt = (
            select(UsageDaily, User.name)
            .join(User, User.id == UsageDaily.user_id)
            .where(*filters)
            .order_by(UsageDaily.day.desc(), UsageDaily.user_id)
            .limit(limit)
            .offset(offset)
        )
        rows = (await self._session.execute(stmt)).all()
        if user_id is None:  # one row per day, not one per (user, day)
            total = await self._session.scalar(
                select(func.coalesce(func.sum(UsageDayTotals.users), 0)).where(UsageDayTotals.day >= since_day)
            )
        else:
            total = await self._session.scalar(select(func.count()).select_from(UsageDaily).where(*filters))
        data = [
            UsageRow(
                user_id=usage.user_id,
                user_name=name,
                day=usage.day,
                requests=int(usage.requests),
                completions=int(usage.completions),
                prompt_tokens=int(usage.prompt_tokens),
                completion_tokens=int(usage.completion_tokens),
                embedding_requests=int(usage.embedding_requests),
                embedding_tokens=int(usage.embedding_tokens),
            )
            for usage, name in rows
        ]
        return data, int(total or 0)
