"""/trace: which user (if any) generated a text (roles auditor and admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from service.deps import ResourcesDep, SessionDep, require_roles
from service.routing import AuthenticatedRoute
from service.schemas.common import ERROR_RESPONSES, Principal
from service.schemas.trace import TraceReport, TraceRequest
from service.services.tracing import TracingService
from service.vocabulary import Role

router = APIRouter(tags=["trace"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)

ForensicDep = Annotated[Principal, Depends(require_roles(Role.AUDITOR, Role.ADMIN))]


async def _tracing(session: SessionDep, resources: ResourcesDep) -> TracingService:
    return TracingService(
        session,
        resources.trace_records,
        resources.settings,
        resources.backend,
        resources.keyring,
        resources.metrics,
        resources.registry_cache,
    )


TracingDep = Annotated[TracingService, Depends(_tracing)]


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
