"""Queries over the traces table: one report by its id, and the audit log (newest first)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from service.models import KeyVersion, Trace, User


@dataclass(frozen=True)
class TraceRow:
    """A trace with the names its report and the audit log show."""

    trace: Trace
    requester_name: str
    key_version: str | None
    key_fingerprint: str | None
    attributed_user_name: str | None


def _with_names() -> Select[Trace, str, str, str, str]:
    requester = aliased(User)
    attributed = aliased(User)
    return (
        select(Trace, requester.name, KeyVersion.name, KeyVersion.fingerprint, attributed.name)
        .join(requester, requester.id == Trace.requester_id)
        .outerjoin(KeyVersion, KeyVersion.id == Trace.key_version_id)
        .outerjoin(attributed, attributed.id == Trace.attributed_user_id)
    )


def _row(
    trace: Trace, requester: str, version: str | None, fingerprint: str | None, attributed: str | None
) -> TraceRow:
    return TraceRow(trace, requester, version, fingerprint, attributed)


class TraceRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def by_report_id(self, report_id: str) -> TraceRow | None:
        row = (await self._session.execute(_with_names().where(Trace.report_id == report_id))).first()
        return None if row is None else _row(*row)

    async def page(
        self,
        *,
        limit: int,
        offset: int,
        verdict: str | None = None,
        requester_id: int | None = None,
        attributed_user_id: int | None = None,
    ) -> tuple[Sequence[TraceRow], int]:
        filters: list[ColumnElement[bool]] = []
        if verdict is not None:
            filters.append(Trace.verdict == verdict)
        if requester_id is not None:
            filters.append(Trace.requester_id == requester_id)
        if attributed_user_id is not None:
            filters.append(Trace.attributed_user_id == attributed_user_id)
        stmt = _with_names().where(*filters).order_by(Trace.created_at.desc(), Trace.id.desc())
        rows = (await self._session.execute(stmt.limit(limit).offset(offset))).all()
        total = await self._session.scalar(select(func.count()).select_from(Trace).where(*filters))
        return [_row(*row) for row in rows], int(total or 0)
