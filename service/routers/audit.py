"""GET /admin/audit: the registry's audit trail (roles auditor and admin)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query

from service.deps import RepositoriesDep, require_roles
from service.errors import InvalidRequestError
from service.repositories.audit import AuditFilters
from service.routing import AuthenticatedRoute
from service.schemas.audit import AuditPage
from service.schemas.common import ERROR_RESPONSES
from service.services.audit_log import AuditLogService
from service.vocabulary import AuditAction, AuditTarget, Role

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_roles(Role.AUDITOR, Role.ADMIN))],
    route_class=AuthenticatedRoute,
)


async def _audit_log(repos: RepositoriesDep) -> AuditLogService:
    return AuditLogService(repos)


AuditLogDep = Annotated[AuditLogService, Depends(_audit_log)]


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@router.get("/audit", response_model=AuditPage)
async def audit_trail(
    log: AuditLogDep,
    action: Annotated[AuditAction | None, Query()] = None,
    target_type: Annotated[AuditTarget | None, Query()] = None,
    target_id: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
    actor_user_id: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
    since: Annotated[
        datetime | None, Query(description="entries at or after this time (ISO 8601; UTC if no zone)")
    ] = None,
    until: Annotated[datetime | None, Query(description="entries before this time")] = None,
    order: Annotated[
        Literal["asc", "desc"], Query(description="asc: oldest first (chain order); desc: newest")
    ] = "asc",
    after_seq: Annotated[
        int | None,
        Query(
            ge=0,
            le=2**62,
            description="keyset paging: the last seq of the previous page (its next_after_seq); the page "
            "continues after it in the order asked",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> AuditPage:
    """Every change to the registry (users, API keys, key versions, message IDs), hash-chained and
    signed: check it offline with `xmark verify-audit`."""
    if since is not None and until is not None and _utc(since) >= _utc(until):
        raise InvalidRequestError("'since' must be earlier than 'until'", param="until")
    filters = AuditFilters(
        action=None if action is None else action.value,
        target_type=None if target_type is None else target_type.value,
        target_id=target_id,
        actor_user_id=actor_user_id,
        since=None if since is None else _utc(since),
        until=None if until is None else _utc(until),
    )
    return await log.page(filters, after_seq=after_seq, limit=limit, newest_first=order == "desc")
