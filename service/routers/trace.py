"""/trace: which user (if any) generated a text (roles auditor and admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from service.deps import BackendDep, KeyringDep, MetricsDep, SessionDep, SettingsDep, require_roles
from service.routing import AuthenticatedRoute
from service.schemas.common import ERROR_RESPONSES, Principal
from service.schemas.trace import TraceReport, TraceRequest
from service.services.registry_cache import RegistryCache
from service.services.tracing import TracingService
from service.vocabulary import Role

router = APIRouter(tags=["trace"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)

ForensicDep = Annotated[Principal, Depends(require_roles(Role.AUDITOR, Role.ADMIN))]


async def _registry(request: Request) -> RegistryCache:
    return request.app.state.registry_cache  # type: ignore[no-any-return]


async def _tracing(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    backend: BackendDep,
    keyring: KeyringDep,
    metrics: MetricsDep,
    registry: Annotated[RegistryCache, Depends(_registry)],
) -> TracingService:
    return TracingService(session, request.app.state.trace_records, settings, backend, keyring, metrics, registry)


TracingDep = Annotated[TracingService, Depends(_tracing)]


@router.post("/trace", response_model=TraceReport, response_model_exclude_none=False)
async def trace(body: TraceRequest, principal: ForensicDep, service: TracingDep) -> TraceReport:
    return await service.trace(principal, body)
