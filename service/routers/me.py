"""GET /me: who the calling API key belongs to (any authenticated key)."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import PrincipalDep
from service.routing import AuthenticatedRoute
from service.schemas.common import ERROR_RESPONSES
from service.schemas.me import Me

router = APIRouter(tags=["me"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)


@router.get("/me", response_model=Me)
async def me(principal: PrincipalDep) -> Me:
    """The caller's user id, name and role (a client decides what to offer from it)."""
    return Me(user_id=principal.user_id, name=principal.name, role=principal.role)
