"""Text fields that no UTF-8 encoder accepts: a lone surrogate (``"a\\ud800b"``, valid JSON) in any
free-text field a client sends is a 422 naming the field, never a 500, and writes nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation, Trace, User

LONE = "a\ud800b"  # what the JSON text "a\\ud800b" decodes to
MODEL = "smollm2-135m-instruct"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str, method: str = "POST") -> Any:
    # json.dumps escapes the surrogate as \\ud800 (ensure_ascii): the body itself is valid UTF-8 JSON
    raw = json.dumps(body).encode()
    assert b"\\ud800" in raw
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return await client.request(method, path, content=raw, headers=headers)


async def _counts(session: AsyncSession) -> tuple[int, ...]:
    return tuple(
        [int(await session.scalar(select(func.count()).select_from(m)) or 0) for m in (User, Generation, Trace)]
    )


CHAT_CASES = [
    (_chat(messages=[{"role": "user", "content": LONE}]), "messages.0.content"),
    (_chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]), "messages.0.content"),
    (_chat(messages=[{"role": "user", "content": "hi", "name": LONE}]), "messages.0.name"),
    (_chat(stop=LONE), "stop"),
    (_chat(stop=["fine", LONE]), "stop"),
    (_chat(model=LONE), "model"),
    (
        _chat(stream=True, messages=[{"role": "system", "content": "x"}, {"role": "user", "content": LONE}]),
        "messages.1.content",
    ),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
async def test_chat_fields_with_lone_surrogates_are_422(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession, body: dict[str, Any], param: str
) -> None:
    _, key = await make_user("user")
    before = await _counts(db_session)
    response = await _post(client, "/v1/chat/completions", body, key)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "\\ud800" not in error["message"] or "surrogate" in error["message"]
    assert await _counts(db_session) == before


@pytest.mark.parametrize("field", ["user", "safety_identifier"])
async def test_an_end_user_identifier_with_a_lone_surrogate_is_400_and_creates_nothing(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession, field: str
) -> None:
    # the end-user identifier's rules are one check (service.end_users.identifier): every refusal a 400
    _, key = await make_user("user")
    before = await _counts(db_session)
    response = await _post(client, "/v1/chat/completions", _chat(**{field: LONE}), key)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "surrogate" in error["message"]
    assert await _counts(db_session) == before


async def test_a_correctly_paired_surrogate_escape_is_accepted(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    body = _chat(messages=[{"role": "user", "content": "smile \U0001f600"}], stop=["\U0001f600"])
    raw = json.dumps(body).encode()
    assert b"\\ud83d\\ude00" in raw  # an escaped pair: one character outside the BMP once decoded
    response = await client.post(
        "/v1/chat/completions",
        content=raw,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("body", "param"), [({"text": LONE}, "text"), ({"text": "fine", "model": LONE}, "model")])
async def test_trace_fields_with_lone_surrogates_are_422(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession, body: dict[str, Any], param: str
) -> None:
    _, key = await make_user("auditor")
    before = await _counts(db_session)
    response = await _post(client, "/trace", body, key)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param
    assert await _counts(db_session) == before


async def test_admin_user_names_with_lone_surrogates_are_422(
    client: httpx.AsyncClient, admin_key: str, make_user: Any, db_session: AsyncSession
) -> None:
    principal, _ = await make_user("user")
    before = await _counts(db_session)
    for method, path in (("POST", "/admin/users"), ("PATCH", f"/admin/users/{principal['id']}")):
        response = await _post(client, path, {"name": LONE}, admin_key, method=method)
        assert response.status_code == 422, (method, response.text)
        assert response.json()["error"]["param"] == "name"
    assert await _counts(db_session) == before
