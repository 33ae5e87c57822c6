"""/trace: which user (if any) generated a text; its signed reports and the audit log (roles
auditor and admin); the public key that verifies reports (no authentication)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query

from service.deps import RepositoriesDep, ResourcesDep, require_roles
from service.routing import AuthenticatedRoute
from service.schemas.common import ERROR_RESPONSES, UNAVAILABLE_RESPONSES, Principal
from service.trace.log import TraceLogService, public_key_of
from service.trace.schemas import ReportKey, TraceLogPage, TraceReport, TraceReportDocument, TraceRequest
from service.trace.service import TracingService
from service.vocabulary import Role, TraceVerdict

router = APIRouter(tags=["trace"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)
# served without authentication: anyone may check a report
public_router = APIRouter(tags=["trace"], responses=UNAVAILABLE_RESPONSES)

ForensicDep = Annotated[Principal, Depends(require_roles(Role.AUDITOR, Role.ADMIN))]
UserIdQuery = Annotated[int | None, Query(ge=1, le=2**31 - 1)]


async def _tracing(repos: RepositoriesDep, resources: ResourcesDep) -> TracingService:
    return TracingService(
        repos,
        resources.trace_records,
        resources.settings,
        resources.fleet,
        resources.keyring,
        resources.metrics,
        resources.registry_cache,
        resources.report_signer,
        resources.sketcher,
    )


async def _trace_log(repos: RepositoriesDep) -> TraceLogService:
    return TraceLogService(repos)


TracingDep = Annotated[TracingService, Depends(_tracing)]
TraceLogDep = Annotated[TraceLogService, Depends(_trace_log)]


@router.post("/trace", response_model=TraceReport, response_model_exclude_none=False)
async def trace(
    body: TraceRequest, principal: ForensicDep, service: TracingDep, resources: ResourcesDep
) -> TraceReport:
    with resources.telemetry.span("trace", {"xmark.trace.decoder_requested": str(body.decoder)}) as span:
        report = await service.trace(principal, body)
        # the verdict, never the text or the message: enough to follow a slow or failing trace
        span.set_attributes(
            {
                "xmark.trace.decoder": str(report.decoder),
                "xmark.trace.watermarked": report.watermarked,
                "xmark.trace.attributed": report.attribution is not None,
                "xmark.trace.scored_tokens": report.scored_tokens,
            }
        )
    return report


@router.get("/trace/{report_id}", response_model=TraceReportDocument)
async def get_report(
    report_id: Annotated[str, Path(min_length=1, max_length=64)], _: ForensicDep, log: TraceLogDep
) -> TraceReportDocument:
    """The signed report of a trace: verify it with the key at /.well-known/xmark-report-key."""
    return await log.report(report_id)


@router.get("/traces", response_model=TraceLogPage)
async def list_traces(
    _: ForensicDep,
    log: TraceLogDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    verdict: Annotated[TraceVerdict | None, Query()] = None,
    requester_id: UserIdQuery = None,
    attributed_user_id: UserIdQuery = None,
) -> TraceLogPage:
    """The audit log: every trace, newest first (who asked, the verdict, whom it named)."""
    return await log.page(
        limit=limit,
        offset=offset,
        verdict=verdict,
        requester_id=requester_id,
        attributed_user_id=attributed_user_id,
    )


@public_router.get("/.well-known/xmark-report-key", response_model=ReportKey)
async def report_key(resources: ResourcesDep) -> ReportKey:
    """The Ed25519 public key that verifies this gateway's trace reports."""
    return public_key_of(resources.report_signer)
