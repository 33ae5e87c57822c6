"""Admin API: users, their API keys, watermark key versions (role admin). Every change is recorded
in the registry's audit trail, in the request's unit of work, as made by the calling admin."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, status

from service.deps import (
    AdminDep,
    RepositoriesDep,
    ResourcesDep,
    require_roles,
)
from service.routing import AuthenticatedRoute
from service.schemas.admin import (
    AddKeyVersionRequest,
    ApiKeyList,
    ApiKeyOut,
    ApiKeyPage,
    CreatedUser,
    CreateUserRequest,
    IssuedKey,
    KeyVersionList,
    KeyVersionOut,
    UpdateUserRequest,
    UsagePage,
    UserOut,
    UserPage,
)
from service.schemas.common import ERROR_RESPONSES
from service.services.audit import Actor, AuditTrail
from service.services.key_versions import KeyVersionService
from service.services.keys import ApiKeyService
from service.services.usage import UsageService
from service.services.users import UserService
from service.vocabulary import Role, UserStatus

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_roles(Role.ADMIN))],
    route_class=AuthenticatedRoute,
)

UserId = Annotated[int, Path(ge=1, le=2**31 - 1)]
KeyId = Annotated[int, Path(ge=1, le=2**31 - 1)]


async def _audit(request: Request, resources: ResourcesDep, principal: AdminDep) -> AuditTrail:
    """The changes of this request: made by the calling admin, under the request's X-Request-ID."""
    request_id = getattr(request.state, "request_id", None)
    return AuditTrail(resources.report_signer, Actor.api(principal.user_id, principal.name), request_id)


AuditDep = Annotated[AuditTrail, Depends(_audit)]


async def _users(repos: RepositoriesDep, resources: ResourcesDep, audit: AuditDep) -> UserService:
    return UserService(
        repos,
        resources.keyring.spec,
        resources.api_key_hasher,
        on_change=resources.registry_cache.invalidate,
        auth_cache=resources.authenticator.cache,
        audit=audit,
    )


async def _keys(repos: RepositoriesDep, resources: ResourcesDep, audit: AuditDep) -> ApiKeyService:
    return ApiKeyService(
        repos,
        resources.api_key_hasher,
        auth_cache=resources.authenticator.cache,
        last_use=resources.authenticator.last_use,
        audit=audit,
    )


async def _key_versions(repos: RepositoriesDep, resources: ResourcesDep, audit: AuditDep) -> KeyVersionService:
    return KeyVersionService(
        repos,
        resources.keyring,
        resources.settings,
        can_generate=resources.secrets_can_generate,
        auth_cache=resources.authenticator.cache,
        audit=audit,
        on_end_user_ids=resources.end_users.ids_added,
    )


async def _usage(repos: RepositoriesDep) -> UsageService:
    return UsageService(repos)


UsersDep = Annotated[UserService, Depends(_users)]
UsageDep = Annotated[UsageService, Depends(_usage)]
KeysDep = Annotated[ApiKeyService, Depends(_keys)]
KeyVersionsDep = Annotated[KeyVersionService, Depends(_key_versions)]


@router.post("/users", status_code=status.HTTP_201_CREATED, response_model=CreatedUser)
async def create_user(body: CreateUserRequest, users: UsersDep) -> CreatedUser:
    """Create a user with a fresh message ID and a first API key (shown only in this response)."""
    return await users.create_user(body.name, body.role, limits=body.limits())


@router.get("/users", response_model=UserPage)
async def list_users(
    users: UsersDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    status_: Annotated[UserStatus | None, Query(alias="status")] = None,
    role: Annotated[Role | None, Query()] = None,
    q: Annotated[str | None, Query(max_length=200, description="case-insensitive substring of the name")] = None,
    after_id: Annotated[
        int | None,
        Query(
            ge=0,
            le=2**31 - 1,
            description="keyset paging: only users with a larger id (the last id of the previous page); "
            "total then counts the matches after it",
        ),
    ] = None,
) -> UserPage:
    return await users.list_users(limit=limit, offset=offset, status=status_, role=role, q=q, after_id=after_id)


@router.get("/users/{user_id}", response_model=UserOut)
async def get_user(user_id: UserId, users: UsersDep) -> UserOut:
    return await users.get_user(user_id)


@router.patch("/users/{user_id}", response_model=UserOut)
async def update_user(user_id: UserId, body: UpdateUserRequest, users: UsersDep) -> UserOut:
    """Change the name, role, admission limits or end-user limits of a user; only the fields sent change.

    A limit sent as null goes back to the gateway's default (``XMARK_USER_*``, ``XMARK_END_USERS_*``,
    ``XMARK_END_USER_*``), 0 means unlimited. The change applies from the user's next request.
    """
    return await users.update_user(user_id, body.changes())


@router.post("/users/{user_id}/disable", response_model=UserOut)
async def disable_user(user_id: UserId, users: UsersDep) -> UserOut:
    return await users.disable_user(user_id)


@router.post("/users/{user_id}/enable", response_model=UserOut)
async def enable_user(user_id: UserId, users: UsersDep) -> UserOut:
    return await users.enable_user(user_id)


@router.delete("/users/{user_id}", response_model=UserOut)
async def delete_user(user_id: UserId, users: UsersDep) -> UserOut:
    """Tombstone the user: status deleted, keys revoked; the row and message ID are kept."""
    return await users.delete_user(user_id)


@router.post("/users/{user_id}/keys", status_code=status.HTTP_201_CREATED, response_model=IssuedKey)
async def issue_key(user_id: UserId, keys: KeysDep) -> IssuedKey:
    """Issue another API key (shown only in this response)."""
    return await keys.issue_key(user_id)


@router.get("/users/{user_id}/keys", response_model=ApiKeyList)
async def list_keys(user_id: UserId, keys: KeysDep) -> ApiKeyList:
    return await keys.list_keys(user_id)


@router.get("/api-keys", response_model=ApiKeyPage)
async def find_keys(
    keys: KeysDep,
    prefix: Annotated[str, Query(max_length=16, description="start of the keys' display prefix")] = "",
    user_id: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="only this user's keys")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> ApiKeyPage:
    """API keys whose display prefix starts with ``prefix`` (all keys without it), of one user or all."""
    return await keys.find_keys(prefix, user_id=user_id, limit=limit, offset=offset)


@router.get("/usage", response_model=UsagePage)
async def usage(
    usage: UsageDep,
    days: Annotated[int, Query(ge=1, le=366)] = 30,
    user_id: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> UsagePage:
    """Requests, completions and tokens per user per UTC day over the last ``days`` days, newest first."""
    return await usage.per_day(days=days, user_id=user_id, limit=limit, offset=offset)


@router.post("/users/{user_id}/keys/{key_id}/revoke", response_model=ApiKeyOut)
async def revoke_key(user_id: UserId, key_id: KeyId, keys: KeysDep) -> ApiKeyOut:
    return await keys.revoke_key(user_id, key_id)


@router.get("/key-versions", response_model=KeyVersionList)
async def list_key_versions(versions: KeyVersionsDep) -> KeyVersionList:
    return await versions.list_versions()


@router.post("/key-versions", status_code=status.HTTP_201_CREATED, response_model=KeyVersionOut)
async def add_key_version(body: AddKeyVersionRequest, versions: KeyVersionsDep) -> KeyVersionOut:
    """Activate a key version whose secret is configured; it encodes new generations from now on."""
    return await versions.activate(body.name)


@router.post("/key-versions/{version_id}/retire", response_model=KeyVersionOut)
async def retire_key_version(
    version_id: Annotated[int, Path(ge=1, le=2**31 - 1)], versions: KeyVersionsDep
) -> KeyVersionOut:
    """Retire a version: it no longer encodes and /trace no longer tries it."""
    return await versions.retire(version_id)
