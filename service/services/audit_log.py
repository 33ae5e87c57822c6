"""Reading the registry's audit trail back (GET /admin/audit): pages by sequence number."""

from __future__ import annotations

from service.repositories.audit import AuditFilters
from service.repositories.unit import Repositories
from service.schemas.audit import AuditEntryOut, AuditHeadOut, AuditPage
from service.services.audit import stored_entry


class AuditLogService:
    def __init__(self, repos: Repositories) -> None:
        self._repo = repos.audit

    async def page(self, filters: AuditFilters, *, after_seq: int | None, limit: int, newest_first: bool) -> AuditPage:
        """The matching entries after ``after_seq`` in the order asked, and the trail's head."""
        rows = await self._repo.page(filters, after_seq=after_seq, limit=limit + 1, newest_first=newest_first)
        has_more = len(rows) > limit
        shown = rows[:limit]
        head = await self._repo.head()
        return AuditPage(
            data=[AuditEntryOut.model_validate(stored_entry(row)) for row in shown],
            limit=limit,
            has_more=has_more,
            next_after_seq=shown[-1].seq if has_more else None,
            head=None if head is None else AuditHeadOut(seq=head[0], entry_hash=head[1]),
        )
