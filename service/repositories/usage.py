"""Usage per user per UTC day, summed from the generations table (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, String, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from service.models import Generation, User


class utc_day(FunctionElement[str]):
    """The UTC calendar day of a timestamp column as ``YYYY-MM-DD`` text, on every backend.

    SQLite stores the gateway's timestamps as naive UTC text (``models.UTCDateTime``);
    PostgreSQL as ``timestamptz``, read in UTC whatever the session's time zone.
    """

    type = String()
    inherit_cache = True
    name = "utc_day"


@compiles(utc_day, "sqlite")
def _utc_day_sqlite(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    return f"date({compiler.process(element.clauses, **kw)})"


@compiles(utc_day, "postgresql")
def _utc_day_postgresql(element: utc_day, compiler: SQLCompiler, **kw: Any) -> str:
    return f"to_char(({compiler.process(element.clauses, **kw)}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


@dataclass(frozen=True)
class UsageRow:
    user_id: int
    user_name: str
    day: str
    requests: int
    completions: int
    prompt_tokens: int
    completion_tokens: int


class UsageRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def per_user_day(
        self, *, since: datetime, user_id: int | None, limit: int, offset: int
    ) -> tuple[Sequence[UsageRow], int]:
        """Rows of ``since`` and later grouped by (user, UTC day), newest day first.

        A request's prompt is counted once (every row of a request carries its prompt tokens; the
        row of choice 0 counts them); completions and completion tokens count every row.
        """
        day = utc_day(Generation.created_at).label("day")
        filters = [Generation.created_at >= since]
        if user_id is not None:
            filters.append(Generation.user_id == user_id)
        prompt = case((Generation.choice_index == 0, Generation.prompt_tokens), else_=0)
        grouped = (
            select(
                Generation.user_id,
                day,
                func.count(func.distinct(Generation.request_id)).label("requests"),
                func.count().label("completions"),
                func.coalesce(func.sum(prompt), 0).cast(Integer).label("prompt_tokens"),
                func.coalesce(func.sum(Generation.completion_tokens), 0).cast(Integer).label("completion_tokens"),
            )
            .where(*filters)
            .group_by(Generation.user_id, day)
            .subquery()
        )
        stmt = (
            select(grouped, User.name)
            .join(User, User.id == grouped.c.user_id)
            .order_by(grouped.c.day.desc(), grouped.c.user_id)
            .limit(limit)
            .offset(offset)
        )
        rows = (await self._session.execute(stmt)).all()
        total = await self._session.scalar(select(func.count()).select_from(grouped))
        data = [
            UsageRow(
                user_id=r.user_id,
                user_name=r.name,
                day=r.day,
                requests=int(r.requests),
                completions=int(r.completions),
                prompt_tokens=int(r.prompt_tokens),
                completion_tokens=int(r.completion_tokens),
            )
            for r in rows
        ]
        return data, int(total or 0)
