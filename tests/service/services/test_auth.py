"""Authentication and roles on every protected route of the app.

Routes are discovered from the app itself, so a new route without an entry in ``ROUTE_ROLES``
(or in ``PUBLIC_ROUTES``) fails ``test_every_route_is_classified``.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import ANTHROPIC_PATHS
from service.models import ApiKey, Generation, Trace, User
from service.security import generate_api_key

PUBLIC_ROUTES = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    # the API reference pages (the schema itself is not an APIRoute)
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    # the public key that verifies trace reports
    ("GET", "/.well-known/xmark-report-key"),
    # the console's static page and modules: they hold no data, the page calls the API with a key
    ("GET", "/console"),
    ("GET", "/console/"),
    ("GET", "/console/static/{name}"),
}
ALL_ROLES = frozenset({"user", "auditor", "admin"})
ADMIN = frozenset({"admin"})
ROUTE_ROLES: dict[tuple[str, str], frozenset[str]] = {
    ("GET", "/v1/models"): ALL_ROLES,
    ("GET", "/v1/models/{model:path}"): ALL_ROLES,
    ("POST", "/v1/chat/completions"): ALL_ROLES,
    ("POST", "/v1/responses"): ALL_ROLES,
    ("POST", "/v1/messages"): ALL_ROLES,
    ("POST", "/v1/messages/count_tokens"): ALL_ROLES,
    ("POST", "/v1/completions"): ALL_ROLES,
    ("POST", "/v1/embeddings"): ALL_ROLES,
    ("POST", "/trace"): frozenset({"auditor", "admin"}),
    ("GET", "/trace/{report_id}"): frozenset({"auditor", "admin"}),
    ("GET", "/traces"): frozenset({"auditor", "admin"}),
    ("GET", "/me"): ALL_ROLES,
    ("GET", "/admin/audit"): frozenset({"auditor", "admin"}),
    ("GET", "/admin/usage"): ADMIN,
    ("GET", "/admin/api-keys"): ADMIN,
    ("POST", "/admin/users"): ADMIN,
    ("GET", "/admin/users"): ADMIN,
    ("GET", "/admin/users/{user_id}"): ADMIN,
    ("PATCH", "/admin/users/{user_id}"): ADMIN,
    ("POST", "/admin/users/{user_id}/disable"): ADMIN,
    ("POST", "/admin/users/{user_id}/enable"): ADMIN,
    ("DELETE", "/admin/users/{user_id}"): ADMIN,
    ("POST", "/admin/users/{user_id}/keys"): ADMIN,
    ("GET", "/admin/users/{user_id}/keys"): ADMIN,
    ("POST", "/admin/users/{user_id}/keys/{key_id}/revoke"): ADMIN,
    ("GET", "/admin/users/{user_id}/end-users"): ADMIN,
    ("PATCH", "/admin/users/{user_id}/end-users/{end_user_id}"): ADMIN,
    ("POST", "/admin/users/{user_id}/end-users/{end_user_id}/disable"): ADMIN,
    ("POST", "/admin/users/{user_id}/end-users/{end_user_id}/enable"): ADMIN,
    ("DELETE", "/admin/users/{user_id}/end-users/{end_user_id}"): ADMIN,
    ("GET", "/admin/key-versions"): ADMIN,
    ("POST", "/admin/key-versions"): ADMIN,
    ("POST", "/admin/key-versions/{version_id}/retire"): ADMIN,
}
BODIES: dict[str, Any] = {
    "/v1/responses": {"model": "smollm2-135m-instruct", "input": "hi", "max_output_tokens": 1},
    "/v1/chat/completions": {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    "/v1/completions": {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1},
    "/v1/messages": {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    "/v1/messages/count_tokens": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": "all-minilm-l6-v2", "input": "hi"},
    "/trace": {"text": "some suspect text"},
    "/admin/users": {"name": "mallory", "role": "admin"},
    "/admin/users/{user_id}": {"role": "admin", "requests_per_minute": 0},
    "/admin/key-versions": {"name": "v2"},
}
PROTECTED = sorted(ROUTE_ROLES)
ROLE_RESTRICTED = [route for route in PROTECTED if ROUTE_ROLES[route] != ALL_ROLES]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


def _body(method: str, path: str) -> Any:
    return BODIES.get(path, {}) if method in {"POST", "PUT", "PATCH"} else None


async def _call(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    return await client.request(method, _concrete(path), json=_body(method, path), headers=headers)


async def _row_counts(session: AsyncSession) -> tuple[int, ...]:
    counts = []
    for model in (User, ApiKey, Generation, Trace):
        counts.append(int(await session.scalar(select(func.count()).select_from(model)) or 0))
    return tuple(counts)


def _anthropic(response: httpx.Response) -> bool:
    """Whether ``response`` answers a route of Anthropic's Messages API (its own error envelope)."""
    return response.request.url.path in ANTHROPIC_PATHS


def _assert_envelope(response: httpx.Response, status: int, type_: str) -> None:
    """The error envelope of the route: OpenAI's, or on Anthropic's Messages API Anthropic's (which
    has no ``param`` or ``code``, and answers a body that does not match the schema with 400)."""
    body = response.json()
    if _anthropic(response):
        assert response.status_code == (400 if status == 422 else status), (response.status_code, response.text)
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"message", "type"}
        assert body["error"]["type"] == type_
        return
    assert response.status_code == status, (response.status_code, response.text)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_


def _assert_code(response: httpx.Response, code: str) -> None:
    """The error's ``code`` (Anthropic's envelope has none: its ``type`` was checked)."""
    if not _anthropic(response):
        assert response.json()["error"]["code"] == code


def test_every_route_is_classified(app: Any) -> None:
    found = {
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
        if method != "HEAD"
    }
    assert found - PUBLIC_ROUTES == set(ROUTE_ROLES)


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_missing_key_is_401(client: httpx.AsyncClient, db_session: AsyncSession, method: str, path: str) -> None:
    before = await _row_counts(db_session)
    response = await _call(client, method, path, {})
    _assert_envelope(response, 401, "authentication_error")
    _assert_code(response, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    assert await _row_counts(db_session) == before


MALFORMED = [
    "Bearer",
    "Basic dXNlcjpwYXNz",
    "Bearer not-a-key",
    "Bearer xm_short_abc",
    # well-formed shape with a wrong checksum
    "Bearer xm_" + "A" * 43 + "_AAAAAA",
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize("header", MALFORMED)
async def test_malformed_key_is_401(client: httpx.AsyncClient, method: str, path: str, header: str) -> None:
    response = await _call(client, method, path, {"Authorization": header})
    _assert_envelope(response, 401, "authentication_error")
    token = header.partition(" ")[2]
    if token:
        assert token not in response.text


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_unknown_well_formed_key_is_401(client: httpx.AsyncClient, method: str, path: str) -> None:
    unknown = generate_api_key().plaintext
    response = await _call(client, method, path, {"Authorization": f"Bearer {unknown}"})
    _assert_envelope(response, 401, "authentication_error")
    assert unknown not in response.text


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_revoked_key_is_401(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, method: str, path: str
) -> None:
    principal, key = await make_user("admin")
    keys = await client.get(f"/admin/users/{principal['id']}/keys", headers={"Authorization": f"Bearer {admin_key}"})
    key_id = keys.json()["data"][0]["id"]
    revoked = await client.post(
        f"/admin/users/{principal['id']}/keys/{key_id}/revoke",
        headers={"Authorization": f"Bearer {admin_key}"},
    )
    assert revoked.status_code == 200
    response = await _call(client, method, path, {"Authorization": f"Bearer {key}"})
    _assert_envelope(response, 401, "authentication_error")
    assert "revoked" in response.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path"), ROLE_RESTRICTED)
async def test_wrong_role_is_403(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession, method: str, path: str
) -> None:
    for role in sorted(ALL_ROLES - ROUTE_ROLES[(method, path)]):
        _, key = await make_user(role)
        before = await _row_counts(db_session)
        response = await _call(client, method, path, {"Authorization": f"Bearer {key}"})
        _assert_envelope(response, 403, "permission_error")
        _assert_code(response, "insufficient_role")
        assert await _row_counts(db_session) == before


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_disabled_user_is_403(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, method: str, path: str
) -> None:
    principal, key = await make_user("admin")
    disabled = await client.post(
        f"/admin/users/{principal['id']}/disable", headers={"Authorization": f"Bearer {admin_key}"}
    )
    assert disabled.status_code == 200
    response = await _call(client, method, path, {"Authorization": f"Bearer {key}"})
    _assert_envelope(response, 403, "permission_error")
    _assert_code(response, "user_disabled")


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_deleted_user_is_refused(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, method: str, path: str
) -> None:
    principal, key = await make_user("admin")
    deleted = await client.delete(f"/admin/users/{principal['id']}", headers={"Authorization": f"Bearer {admin_key}"})
    assert deleted.status_code == 200
    response = await _call(client, method, path, {"Authorization": f"Bearer {key}"})
    # deletion revokes every key of the user
    _assert_envelope(response, 401, "authentication_error")


async def test_right_role_passes_authentication(client: httpx.AsyncClient, make_user: Any) -> None:
    _, auditor = await make_user("auditor")
    response = await client.get("/v1/models", headers={"Authorization": f"Bearer {auditor}"})
    assert response.status_code == 200
    _, admin = await make_user("admin")
    response = await client.get("/admin/key-versions", headers={"Authorization": f"Bearer {admin}"})
    assert response.status_code == 200


async def test_bearer_scheme_is_case_insensitive(client: httpx.AsyncClient, admin_key: str) -> None:
    response = await client.get("/admin/users", headers={"Authorization": f"bearer {admin_key}"})
    assert response.status_code == 200


BODY_ROUTES = [route for route in PROTECTED if route[0] == "POST" and route[1] in BODIES]


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"text": }'])
async def test_authentication_is_checked_before_the_body_is_parsed(
    client: httpx.AsyncClient, make_user: Any, method: str, path: str, raw: bytes
) -> None:
    headers = {"Content-Type": "application/json"}
    anonymous = await client.request(method, _concrete(path), content=raw, headers=headers)
    _assert_envelope(anonymous, 401, "authentication_error")
    unknown = generate_api_key().plaintext
    stranger = await client.request(
        method, _concrete(path), content=raw, headers={**headers, "Authorization": f"Bearer {unknown}"}
    )
    _assert_envelope(stranger, 401, "authentication_error")
    _, key = await make_user("admin")  # admins may call every route: the body is what is wrong
    authenticated = await client.request(
        method, _concrete(path), content=raw, headers={**headers, "Authorization": f"Bearer {key}"}
    )
    _assert_envelope(authenticated, 422, "invalid_request_error")
    _assert_code(authenticated, "invalid_json")


async def test_validation_errors_still_name_the_field_for_authenticated_callers(
    client: httpx.AsyncClient, make_user: Any
) -> None:
    _, key = await make_user("user")
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "smollm2-135m-instruct", "messages": [], "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}"},
    )
    _assert_envelope(response, 422, "invalid_request_error")
    assert response.json()["error"]["param"] == "messages"
    assert "messages" in response.json()["error"]["message"]
