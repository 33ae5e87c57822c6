"""The route class of every router: protected routes authenticate before the body is read.

FastAPI parses a JSON body before it solves dependencies, so an anonymous request with a
malformed body would get 422 where it should get 401. On a route that depends on
``current_principal`` (directly or through ``require_roles``), this class resolves the caller
first; validation errors (422) are then only ever reported to authenticated callers.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from service.deps import current_principal, resolve_principal


def needs_principal(dependant: Dependant) -> bool:
    """Whether ``dependant`` or any of its sub-dependencies is ``current_principal``."""
    return any(
        dependency.call is current_principal or needs_principal(dependency) for dependency in dependant.dependencies
    )


class AuthenticatedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not needs_principal(self.dependant):
            return handler

        async def authenticate_first(request: Request) -> Response:
            await resolve_principal(request)
            return await handler(request)

        return authenticate_first
