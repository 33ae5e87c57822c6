"""Admin API of an account's end users (role admin): list and search (with their limits and usage),
change an end user's own rate limits, disable, enable, delete. Every change is recorded in the
registry's audit trail as made by the calling admin."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query

from service.deps import RepositoriesDep, ResourcesDep, require_roles
from service.end_users.schemas import EndUserOut, EndUserPage, UpdateEndUserRequest
from service.end_users.service import EndUserService
from service.routers.admin import AuditDep, UserId
from service.routing import AuthenticatedRoute
from service.schemas.common import ERROR_RESPONSES
from service.vocabulary import EndUserStatus, Role

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_roles(Role.ADMIN))],
    route_class=AuthenticatedRoute,
)

EndUserId = Annotated[int, Path(ge=1, le=2**31 - 1)]


async def _end_users(repos: RepositoriesDep, resources: ResourcesDep, audit: AuditDep) -> EndUserService:
    return EndUserService(
        repos,
        settings=resources.settings,
        cache=resources.end_users.cache,
        on_change=resources.registry_cache.invalidate,
        audit=audit,
    )


EndUsersDep = Annotated[EndUserService, Depends(_end_users)]


@router.get("/users/{user_id}/end-users", response_model=EndUserPage)
async def list_end_users(
    user_id: UserId,
    end_users: EndUsersDep,
    q: Annotated[str | None, Query(max_length=256, description="case-insensitive substring of the identifier")] = None,
    status_: Annotated[EndUserStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> EndUserPage:
    """The account's end users by id, with their identifiers as sent, message IDs, first and last seen,
    the limits their requests are held to and their usage over the last 24 hours."""
    return await end_users.list_end_users(user_id, limit=limit, offset=offset, q=q, status=status_)


@router.patch("/users/{user_id}/end-users/{end_user_id}", response_model=EndUserOut)
async def update_end_user(
    user_id: UserId, end_user_id: EndUserId, body: UpdateEndUserRequest, end_users: EndUsersDep
) -> EndUserOut:
    """Change the end user's own requests and tokens per minute; only the fields sent change.

    A limit sent as null goes back to the account's end-user limit (else the gateway's default),
    0 means unlimited. The change applies from the end user's next request (other replicas within
    ``XMARK_AUTH_CACHE_TTL_S``); 409 for a deleted end user.
    """
    return await end_users.update(user_id, end_user_id, body.changes())


@router.post("/users/{user_id}/end-users/{end_user_id}/disable", response_model=EndUserOut)
async def disable_end_user(user_id: UserId, end_user_id: EndUserId, end_users: EndUsersDep) -> EndUserOut:
    """Its requests get 403 from now on; the account's other end users are unaffected."""
    return await end_users.disable(user_id, end_user_id)


@router.post("/users/{user_id}/end-users/{end_user_id}/enable", response_model=EndUserOut)
async def enable_end_user(user_id: UserId, end_user_id: EndUserId, end_users: EndUsersDep) -> EndUserOut:
    return await end_users.enable(user_id, end_user_id)


@router.delete("/users/{user_id}/end-users/{end_user_id}", response_model=EndUserOut)
async def delete_end_user(user_id: UserId, end_user_id: EndUserId, end_users: EndUsersDep) -> EndUserOut:
    """Tombstone the end user: its requests get 403; its message IDs stay reserved and its texts keep tracing."""
    return await end_users.delete(user_id, end_user_id)
