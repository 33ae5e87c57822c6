"""FastAPI dependencies: the request session (the only committer), app resources, auth."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from service.backends import Backend
from service.config import Settings
from service.db import session_scope
from service.errors import PermissionDeniedError, speaks_anthropic
from service.keyring import Keyring
from service.metrics import Metrics
from service.repositories.unit import Repositories
from service.resources import Resources
from service.schemas.common import Principal, Role
from service.security import ApiKeyHasher
from service.services.auth_edge import AuthEdge
from service.services.keys import parse_api_key_headers, parse_bearer

__all__ = [
    "AdminDep",
    "ApiKeyHasherDep",
    "BackendDep",
    "KeyringDep",
    "MetricsDep",
    "Principal",
    "PrincipalDep",
    "RepositoriesDep",
    "Resources",
    "ResourcesDep",
    "SessionDep",
    "SettingsDep",
    "current_principal",
    "get_resources",
    "get_session",
    "require_roles",
    "resolve_principal",
]


async def get_resources(request: Request) -> Resources:
    """The process's resources (opened by the lifespan)."""
    resources: Resources = request.app.state.resources
    return resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


async def get_session(resources: ResourcesDep) -> AsyncIterator[AsyncSession]:
    """The request's unit of work: commits when the endpoint succeeds, rolls back otherwise.

    It is closed (committed) before the response is sent (``scope="function"`` below), so a
    client never sees a success whose writes are not durable yet, and a failing commit turns into
    an error response. Streamed responses write in units of work of their own.
    """
    async with session_scope(resources.sessionmaker) as session:
        yield session


async def get_repositories(
    session: Annotated[AsyncSession, Depends(get_session, scope="function")], resources: ResourcesDep
) -> Repositories:
    """The request's session's repositories, what the route's services are given."""
    return Repositories(session, planner=resources.planner_statistics)


async def get_settings(resources: ResourcesDep) -> Settings:
    return resources.settings


async def get_keyring(resources: ResourcesDep) -> Keyring:
    return resources.keyring


async def get_metrics(resources: ResourcesDep) -> Metrics:
    return resources.metrics


async def get_backend(resources: ResourcesDep) -> Backend:
    return resources.backend


async def get_api_key_hasher(resources: ResourcesDep) -> ApiKeyHasher:
    return resources.api_key_hasher


SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]
RepositoriesDep = Annotated[Repositories, Depends(get_repositories)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
KeyringDep = Annotated[Keyring, Depends(get_keyring)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
BackendDep = Annotated[Backend, Depends(get_backend)]
ApiKeyHasherDep = Annotated[ApiKeyHasher, Depends(get_api_key_hasher)]


def client_address(request: Request, edge: AuthEdge | None) -> str | None:
    """The request's client address bucket for the failed-authentication budget (``X-Forwarded-For``
    only from a trusted proxy; None without a budget or for an address exempt from it)."""
    if edge is None:
        return None
    peer = request.client.host if request.client is not None else None
    return edge.address(peer, request.headers.getlist("x-forwarded-for"))


async def resolve_principal(request: Request) -> Principal:
    """Authenticate the request once (cached on ``request.state``). The key comes as a bearer
    token; on the routes of Anthropic's Messages API also as ``x-api-key``, as its clients send it."""
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None:
        resources: Resources = request.app.state.resources
        with resources.telemetry.span("auth") as span:
            client = client_address(request, resources.authenticator.edge)
            authorization = request.headers.get("authorization")
            if speaks_anthropic(request.scope):
                key = parse_api_key_headers(request.headers.get("x-api-key"), authorization)
            else:
                key = parse_bearer(authorization)
            principal = await resources.authenticator.authenticate_key(key, client)
            span.set_attribute("enduser.id", str(principal.user_id))
            span.set_attribute("enduser.role", str(principal.role))
        request.state.principal = principal
    return principal


async def current_principal(request: Request) -> Principal:
    """401 for a missing, malformed, unknown or revoked key; 403 for a disabled or deleted user.

    Needs no database round trip when the key is in the authentication cache.
    """
    return await resolve_principal(request)


PrincipalDep = Annotated[Principal, Depends(current_principal)]


def require_roles(*roles: Role) -> Callable[[Principal], Awaitable[Principal]]:
    """Dependency factory: the caller must hold one of ``roles`` (403 otherwise)."""
    allowed = frozenset(roles)

    async def dependency(principal: PrincipalDep) -> Principal:
        if principal.role not in allowed:
            raise PermissionDeniedError(
                f"This endpoint requires the role {' or '.join(sorted(allowed))}",
                code="insufficient_role",
            )
        return principal

    return dependency


AdminDep = Annotated[Principal, Depends(require_roles(Role.ADMIN))]
