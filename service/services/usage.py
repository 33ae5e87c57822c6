"""Usage per user per day (GET /admin/usage), from the generation and embedding records."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

from service.repositories.unit import Repositories
from service.schemas.admin import UsageDay, UsagePage


def window_start(days: int, now: datetime) -> datetime:
    """Midnight UTC of the first of the last ``days`` UTC days (today included)."""
    today = now.astimezone(UTC).date()
    return datetime.combine(today - timedelta(days=days - 1), time.min, tzinfo=UTC)


class UsageService:
    def __init__(self, repos: Repositories) -> None:
        self._usage = repos.usage

    async def per_day(self, *, days: int, user_id: int | None, limit: int, offset: int) -> UsagePage:
        since = window_start(days, datetime.now(UTC))
        rows, total = await self._usage.per_user_day(since=since, user_id=user_id, limit=limit, offset=offset)
        data = [
            UsageDay(
                user_id=r.user_id,
                user_name=r.user_name,
                day=r.day,
                requests=r.requests,
                completions=r.completions,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                embedding_requests=r.embedding_requests,
                embedding_tokens=r.embedding_tokens,
            )
            for r in rows
        ]
        return UsagePage.of(data, total=total, limit=limit, offset=offset)
