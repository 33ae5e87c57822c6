"""Reading traces back: one signed report (GET /trace/{report_id}) and the audit log (GET /traces)."""

from __future__ import annotations

from service.errors import NotFoundError
from service.repositories.unit import Repositories
from service.services.reports import ReportSigner
from service.trace.report import report_document
from service.trace.schemas import ReportKey, TraceLogEntry, TraceLogPage, TraceReportDocument
from service.vocabulary import TraceDecoder, TraceVerdict


def public_key_of(signer: ReportSigner) -> ReportKey:
    """What verifies the gateway's reports (served without authentication)."""
    return ReportKey(key_id=signer.key_id, public_key=signer.public_key_b64)


class TraceLogService:
    def __init__(self, repos: Repositories) -> None:
        self._traces = repos.traces

    async def report(self, report_id: str) -> TraceReportDocument:
        row = await self._traces.by_report_id(report_id)
        if row is None:
            raise NotFoundError(f"Trace report '{report_id}' not found", param="report_id", code="report_not_found")
        return report_document(
            row.trace,
            key_version=row.key_version,
            key_fingerprint=row.key_fingerprint,
            attributed_name=row.attributed_user_name,
        )

    async def page(
        self,
        *,
        limit: int,
        offset: int,
        verdict: TraceVerdict | None = None,
        requester_id: int | None = None,
        attributed_user_id: int | None = None,
    ) -> TraceLogPage:
        rows, total = await self._traces.page(
            limit=limit,
            offset=offset,
            verdict=None if verdict is None else str(verdict),
            requester_id=requester_id,
            attributed_user_id=attributed_user_id,
        )
        data = [
            TraceLogEntry(
                report_id=r.trace.report_id,
                created_at=r.trace.created_at,
                requester_id=r.trace.requester_id,
                requester_name=r.requester_name,
                verdict=TraceVerdict(r.trace.verdict),
                decoder=TraceDecoder(r.trace.decoder),
                p_value=r.trace.p_value,
                scored_tokens=r.trace.scored_tokens,
                key_version=r.key_version,
                attributed_user_id=r.trace.attributed_user_id,
                attributed_user_name=r.attributed_user_name,
                attributed_end_user_id=r.trace.attributed_end_user_id,
            )
            for r in rows
        ]
        return TraceLogPage.of(data, total=total, limit=limit, offset=offset)
