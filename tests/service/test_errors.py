"""Bad input gets the right 4xx envelope, writes nothing, and never echoes secrets (responses or logs)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.logging import JsonFormatter
from service.models import ApiKey, User

ENVELOPE_KEYS = {"message", "type", "param", "code"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _counts(session: AsyncSession) -> tuple[int, int]:
    users = await session.scalar(select(func.count()).select_from(User))
    keys = await session.scalar(select(func.count()).select_from(ApiKey))
    return int(users or 0), int(keys or 0)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS
    return body["error"]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"name": 123, "role": "user"}, "name"),
        ({"name": ["a"], "role": "user"}, "name"),
        ({"name": "ok", "role": "superuser"}, "role"),
        ({"name": "ok", "role": 7}, "role"),
        ({"role": "user"}, "name"),
        ({"name": "ok", "role": "user", "is_root": True}, "is_root"),
    ],
)
async def test_invalid_bodies_name_the_field_and_write_nothing(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession, payload: Any, param: str
) -> None:
    before = await _counts(db_session)
    response = await client.post("/admin/users", json=payload, headers=bearer(admin_key))
    error = _error(response, 422)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]
    assert await _counts(db_session) == before


@pytest.mark.parametrize("raw", [b"{", b'{"name": "a", "role": "user"', b"not json at all", b'{"name": }'])
async def test_malformed_json_is_422_and_writes_nothing(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession, raw: bytes
) -> None:
    before = await _counts(db_session)
    response = await client.post(
        "/admin/users",
        content=raw,
        headers={**bearer(admin_key), "Content-Type": "application/json"},
    )
    error = _error(response, 422)
    assert error["code"] == "invalid_json"
    assert await _counts(db_session) == before


async def test_non_object_body_is_422(client: httpx.AsyncClient, admin_key: str) -> None:
    response = await client.post("/admin/users", json=["name", "role"], headers=bearer(admin_key))
    assert _error(response, 422)["type"] == "invalid_request_error"


async def test_empty_body_is_422(client: httpx.AsyncClient, admin_key: str) -> None:
    response = await client.post("/admin/users", headers=bearer(admin_key))
    error = _error(response, 422)
    assert error["code"] == "missing_field"


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=abc", "limit"),
        ("limit=0", "limit"),
        ("limit=100000", "limit"),
        ("offset=-1", "offset"),
        ("status=gone", "status"),
    ],
)
async def test_bad_query_parameters(client: httpx.AsyncClient, admin_key: str, query: str, param: str) -> None:
    error = _error(await client.get(f"/admin/users?{query}", headers=bearer(admin_key)), 422)
    assert error["param"] == param


async def test_bad_path_parameter(client: httpx.AsyncClient, admin_key: str) -> None:
    error = _error(await client.get("/admin/users/abc", headers=bearer(admin_key)), 422)
    assert error["param"] == "user_id"


async def test_unknown_route_and_method(client: httpx.AsyncClient, admin_key: str) -> None:
    assert _error(await client.get("/nope"), 404)["type"] == "not_found_error"
    assert _error(await client.put("/admin/users", headers=bearer(admin_key)), 405)["code"] == "method_not_allowed"


async def test_oversized_body_by_content_length_is_413(
    app: Any, client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    before = await _counts(db_session)
    limit = app.state.resources.settings.max_body_bytes
    payload = b'{"name": "' + b"a" * limit + b'", "role": "user"}'
    response = await client.post(
        "/admin/users", content=payload, headers={**bearer(admin_key), "Content-Type": "application/json"}
    )
    error = _error(response, 413)
    assert error["code"] == "payload_too_large"
    assert await _counts(db_session) == before


async def test_oversized_streamed_body_is_413(
    app: Any, client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    before = await _counts(db_session)
    limit = app.state.resources.settings.max_body_bytes

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"name": "'
        for _ in range(limit // 65536 + 2):
            yield b"a" * 65536
        yield b'", "role": "user"}'

    response = await client.post(
        "/admin/users", content=chunks(), headers={**bearer(admin_key), "Content-Type": "application/json"}
    )
    assert "content-length" not in {k.lower() for k in response.request.headers}
    assert _error(response, 413)["code"] == "payload_too_large"
    assert await _counts(db_session) == before


async def test_small_streamed_body_is_accepted(client: httpx.AsyncClient, admin_key: str) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"name": "streamed",'
        yield b' "role": "user"}'

    response = await client.post(
        "/admin/users", content=chunks(), headers={**bearer(admin_key), "Content-Type": "application/json"}
    )
    assert response.status_code == 201


def _log_lines(records: list[logging.LogRecord]) -> str:
    formatter = JsonFormatter()
    return "\n".join(formatter.format(r) + repr(r.__dict__) for r in records)


async def test_planted_secrets_never_appear_in_responses_or_logs(
    app: Any,
    client: httpx.AsyncClient,
    admin_key: str,
    make_user: Any,
    caplog: pytest.LogCaptureFixture,
    planted_secrets: list[str],
) -> None:
    _, other_key = await make_user("user")
    secrets = [*planted_secrets, admin_key, other_key]
    caplog.set_level(logging.DEBUG)
    responses: list[httpx.Response] = []
    for key in (admin_key, other_key):
        # a user name is echoed by design, but one containing an API key is refused
        refused = await client.post(
            "/admin/users", json={"name": f"x {key}", "role": "user"}, headers=bearer(admin_key)
        )
        assert refused.status_code == 422
        responses.append(refused)
    for secret in secrets:
        responses += [
            await client.post("/admin/users", json={"name": "n", "role": secret}, headers=bearer(admin_key)),
            await client.post("/admin/users", json={"name": "n", secret: 1}, headers=bearer(admin_key)),
            await client.post(
                "/admin/users",
                content=b'{"name": "' + secret.encode() + b'", ',
                headers={**bearer(admin_key), "Content-Type": "application/json"},
            ),
            await client.post("/admin/key-versions", json={"name": secret}, headers=bearer(admin_key)),
            await client.get(f"/admin/users?status={secret}", headers=bearer(admin_key)),
            await client.get(f"/admin/users/{secret}", headers=bearer(admin_key)),
            await client.get("/admin/users", headers={"Authorization": f"Bearer {secret}x"}),
            await client.get("/admin/users", headers={"Authorization": secret}),
            await client.get("/admin/users", headers={**bearer(admin_key), "X-Request-ID": secret}),
            await client.post(
                "/v1/chat/completions", json={"model": secret, "messages": secret}, headers=bearer(other_key)
            ),
            await client.post("/trace", json={"text": 5, "extra": secret}, headers=bearer(admin_key)),
        ]
    for response in responses:
        assert 200 <= response.status_code < 500, response.text
        for secret in secrets:
            assert secret not in response.text
            for value in response.headers.values():
                assert secret not in value
    # the test's own HTTP client logs request URLs; everything else is the gateway's
    logged = _log_lines([r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))])
    assert "xmark.access" in logged  # the requests were logged
    for secret in secrets:
        assert secret not in logged
    hasher = app.state.resources.api_key_hasher
    assert repr(hasher).count("pepper") == 1 and "hidden" in repr(hasher)


async def test_internal_errors_hide_details(
    app: Any, client: httpx.AsyncClient, admin_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Unexpected failures answer a generic 500 envelope (no exception text)."""
    original = app.state.resources.keyring
    app.state.resources.keyring = None  # any access now raises AttributeError inside the handler
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as raw:
            response = await raw.post("/admin/users", json={"name": "x"}, headers=bearer(admin_key))
    finally:
        app.state.resources.keyring = original
    error = _error(response, 500)
    assert error["message"] == "Internal server error"
    assert "AttributeError" not in response.text
