"""End users of an account: the request fields that name one, first sight and its caps, the cache
(no database round trip for a known end user), concurrent first sights, disabling, the admin API
and its audit entries; each end user's rate and token limits, the account's overrides of the caps
and of those limits, and the limits and usage the admin API shows."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncSession

import service.resources
from service.app import create_app
from service.config import Settings
from service.db import session_scope, upgrade_database
from service.metrics import Metrics
from service.models import EndUser, Generation, MessageId, RegistryAuditEntry
from service.repositories.unit import Repositories
from service.services.admission import Admission
from service.services.users import UserService
from service.vocabulary import Role
from tests.conftest import make_test_settings
from tests.fakes import FakeBackend
from tests.service.conftest import own_database

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello."}]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, **fields}


@pytest.fixture
async def fake(app: Any) -> AsyncIterator[FakeBackend]:
    """A fake backend in place of the shared app's for one test (the app serves the real model when
    another selected module needs it): it keeps the stamp of every request it is asked to answer."""
    resources = app.state.resources
    saved = resources.backend
    backend = FakeBackend(resources.settings.model_name)
    await backend.start()
    resources.backend = backend
    try:
        yield backend
    finally:
        resources.backend = saved


@pytest.fixture
def limits(app: Any) -> Iterator[Callable[..., None]]:
    """``limits(**settings)``: from now on in this test, requests are admitted by fresh counters
    and first sights capped under the app's settings with these values (restored afterwards)."""
    resources = app.state.resources
    saved = resources.admission, resources.end_users._settings

    def apply(**update: Any) -> None:
        settings = resources.settings.model_copy(update=update)
        resources.admission = Admission(settings, Metrics())
        resources.end_users._settings = settings

    yield apply
    resources.admission, resources.end_users._settings = saved


def _stamped(app: Any) -> str:
    """The message ID the backend was last asked to embed."""
    return str(app.state.resources.backend.requests[-1][1].message.bits)


async def _end_users(session: AsyncSession, user_id: int) -> list[EndUser]:
    return list((await session.scalars(select(EndUser).where(EndUser.user_id == user_id))).all())


async def _ids_of(session: AsyncSession, end_user_id: int) -> set[str]:
    rows = await session.scalars(select(MessageId.message_id).where(MessageId.end_user_id == end_user_id))
    return set(rows.all())


async def test_each_field_names_an_end_user_whose_message_id_is_embedded(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, fake: FakeBackend
) -> None:
    account, key = await make_user("user")
    cases = [
        ("/v1/chat/completions", _chat(safety_identifier="eu-safety")),
        ("/v1/chat/completions", _chat(user="eu-user")),
        ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "safety_identifier": "eu-text"}),
        ("/v1/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 4, "user": "eu-responses"}),
        (
            "/v1/messages",
            {"model": MODEL, "messages": HELLO, "max_tokens": 4, "metadata": {"user_id": "eu-anthropic"}},
        ),
    ]
    stamped: dict[str, str] = {}
    for path, body in cases:
        headers = _auth(key) if path != "/v1/messages" else {"x-api-key": key}
        response = await client.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        identifier = body.get("safety_identifier") or body.get("user") or body["metadata"]["user_id"]
        stamped[identifier] = _stamped(app)
    rows = {row.identifier: row for row in await _end_users(db_session, account["id"])}
    assert set(rows) == set(stamped)
    account_ids = {m["message_id"] for m in account["message_ids"]}
    for identifier, row in rows.items():
        ids = await _ids_of(db_session, row.id)
        assert stamped[identifier] in ids  # its own ID was embedded, not the account's
        assert not ids & account_ids
        assert row.status == "active"
    assert len(set(stamped.values())) == len(stamped)
    # the records keep the end user (and the account)
    records = (await db_session.execute(select(Generation.user_id, Generation.end_user_id))).all()
    assert {(account["id"], row.id) for row in rows.values()} <= set(records)
    # without the field, the account's own ID as before
    assert (await client.post("/v1/chat/completions", json=_chat(), headers=_auth(key))).status_code == 200
    assert _stamped(app) in account_ids


async def test_bad_identifiers_are_refused_by_name_and_create_nothing(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, fake: FakeBackend
) -> None:
    account, key = await make_user("user")
    cases = [
        (_chat(safety_identifier=""), "safety_identifier"),
        (_chat(safety_identifier="x" * 257), "safety_identifier"),
        (_chat(user=7), "user"),
        (_chat(safety_identifier="a", user="b"), "safety_identifier"),
        (_chat(user="xm_" + "A" * 43 + "_" + "B" * 6), "user"),
    ]
    for body, param in cases:
        response = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "xm_" not in response.text
    anthropic = await client.post(
        "/v1/messages",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 4, "metadata": {"user_id": ""}},
        headers={"x-api-key": key},
    )
    assert anthropic.status_code == 400 and "metadata.user_id" in anthropic.json()["error"]["message"]
    # the same value under both names is one end user
    same = await client.post("/v1/chat/completions", json=_chat(safety_identifier="s", user="s"), headers=_auth(key))
    assert same.status_code == 200
    assert [row.identifier for row in await _end_users(db_session, account["id"])] == ["s"]


async def test_a_known_end_user_costs_no_database_round_trip(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, fake: FakeBackend
) -> None:
    _, key = await make_user("user")
    body = _chat(safety_identifier="warm")
    assert (await client.post("/v1/chat/completions", json=body, headers=_auth(key))).status_code == 200
    first = _stamped(app)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    engine = app.state.resources.engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        assert (await client.post("/v1/chat/completions", json=body, headers=_auth(key))).status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert _stamped(app) == first  # the same end user, the same ID
    assert not [s for s in statements if "end_users" in s], statements


async def test_two_accounts_with_one_identifier_have_two_end_users(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, fake: FakeBackend
) -> None:
    stamped = []
    for _ in range(2):
        _, key = await make_user("user")
        response = await client.post("/v1/chat/completions", json=_chat(user="same-name"), headers=_auth(key))
        assert response.status_code == 200
        stamped.append(_stamped(app))
    assert stamped[0] != stamped[1]
    count = await db_session.scalar(select(func.count()).select_from(EndUser).where(EndUser.identifier == "same-name"))
    assert count == 2


async def test_the_caps_give_429_naming_the_cap_and_allocate_nothing(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, fake: FakeBackend
) -> None:
    directory = app.state.resources.end_users
    original = directory._settings
    for cap in ("end_users_max_per_account", "end_users_new_per_minute"):
        account, key = await make_user("user")
        directory._settings = original.model_copy(update={cap: 1})
        try:
            first = await client.post("/v1/chat/completions", json=_chat(user="first"), headers=_auth(key))
            assert first.status_code == 200
            ids_before = await db_session.scalar(select(func.count()).select_from(MessageId))
            refused = await client.post("/v1/chat/completions", json=_chat(user="second"), headers=_auth(key))
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "end_user_limit_exceeded" and cap in error["message"]
            assert error["type"] == "rate_limit_error" and refused.headers["retry-after"]
            assert await db_session.scalar(select(func.count()).select_from(MessageId)) == ids_before
            # a known end user is not held back by the cap
            again = await client.post("/v1/chat/completions", json=_chat(user="first"), headers=_auth(key))
            assert again.status_code == 200
        finally:
            directory._settings = original
        assert [row.identifier for row in await _end_users(db_session, account["id"])] == ["first"]


async def test_admin_routes_list_disable_enable_delete_with_audit_entries(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, admin_key: str, fake: FakeBackend
) -> None:
    account, key = await make_user("user")
    for name in ("alice-hmac", "bob-hmac"):
        assert (await client.post("/v1/chat/completions", json=_chat(user=name), headers=_auth(key))).status_code == 200
    base = f"/admin/users/{account['id']}/end-users"
    page = (await client.get(base, headers=_auth(admin_key))).json()
    assert page["total"] == 2 and [e["identifier"] for e in page["data"]] == ["alice-hmac", "bob-hmac"]
    assert all(e["message_ids"] and e["created_at"] and e["last_seen_at"] for e in page["data"])
    found = (await client.get(base, params={"q": "ALICE"}, headers=_auth(admin_key))).json()
    assert [e["identifier"] for e in found["data"]] == ["alice-hmac"]
    paged = (await client.get(base, params={"limit": 1, "offset": 1}, headers=_auth(admin_key))).json()
    assert [e["identifier"] for e in paged["data"]] == ["bob-hmac"] and not paged["has_more"]
    alice, bob = page["data"]
    # a user may not use the admin API
    assert (await client.get(base, headers=_auth(key))).status_code == 403

    disabled = await client.post(f"{base}/{alice['id']}/disable", headers=_auth(admin_key))
    assert disabled.status_code == 200 and disabled.json()["status"] == "disabled"
    refused = await client.post("/v1/chat/completions", json=_chat(user="alice-hmac"), headers=_auth(key))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "end_user_disabled"
    # the account's other end users, and the account itself, still work
    assert (
        await client.post("/v1/chat/completions", json=_chat(user="bob-hmac"), headers=_auth(key))
    ).status_code == 200
    assert (await client.post("/v1/chat/completions", json=_chat(), headers=_auth(key))).status_code == 200

    enabled = await client.post(f"{base}/{alice['id']}/enable", headers=_auth(admin_key))
    assert enabled.json()["status"] == "active"
    assert (
        await client.post("/v1/chat/completions", json=_chat(user="alice-hmac"), headers=_auth(key))
    ).status_code == 200

    deleted = await client.delete(f"{base}/{bob['id']}", headers=_auth(admin_key))
    assert deleted.status_code == 200 and deleted.json()["status"] == "deleted"
    assert deleted.json()["message_ids"] == bob["message_ids"]  # the IDs stay reserved
    gone = await client.post("/v1/chat/completions", json=_chat(user="bob-hmac"), headers=_auth(key))
    assert gone.status_code == 403 and gone.json()["error"]["code"] == "end_user_deleted"
    assert (await client.post(f"{base}/{bob['id']}/enable", headers=_auth(admin_key))).status_code == 409
    assert (await client.post(f"{base}/999999/disable", headers=_auth(admin_key))).status_code == 404
    assert (await client.get("/admin/users/999999/end-users", headers=_auth(admin_key))).status_code == 404

    entries = (
        await db_session.scalars(
            select(RegistryAuditEntry)
            .where(RegistryAuditEntry.target_type == "end_user")
            .order_by(RegistryAuditEntry.seq)
        )
    ).all()
    by_action = [(e.action, e.target_id, e.actor_kind) for e in entries]
    assert by_action == [
        ("end_user.create", str(alice["id"]), "api"),
        ("end_user.create", str(bob["id"]), "api"),
        ("end_user.disable", str(alice["id"]), "api"),
        ("end_user.enable", str(alice["id"]), "api"),
        ("end_user.delete", str(bob["id"]), "api"),
    ]
    assert entries[0].actor_user_id == account["id"]  # first sight: made by the account
    assert entries[0].changes["after"]["identifier"] == "alice-hmac"
    assert entries[2].actor_name == "test-admin" and entries[2].changes == {
        "before": {"status": "active"},
        "after": {"status": "disabled", "user_id": account["id"], "identifier": "alice-hmac"},
    }
    # the trail still verifies
    verified = await client.get("/admin/audit", params={"limit": 500}, headers=_auth(admin_key))
    assert verified.status_code == 200


# -- each end user's rate and token limits; the account's overrides -------------------------------


async def _send(client: httpx.AsyncClient, key: str, identifier: str | None = None, **fields: Any) -> httpx.Response:
    body = _chat(**fields) if identifier is None else _chat(user=identifier, **fields)
    return await client.post("/v1/chat/completions", json=body, headers=_auth(key))


def _statuses(responses: list[httpx.Response]) -> list[int]:
    return [r.status_code for r in responses]


async def _patch(client: httpx.AsyncClient, admin_key: str, path: str, field: str, value: int | None) -> None:
    response = await client.patch(path, json={field: value}, headers=_auth(admin_key))
    assert response.status_code == 200 and response.json()[field] == value, response.text


async def test_an_end_user_past_its_request_limit_gets_429_naming_it_while_a_sibling_gets_200(
    client: httpx.AsyncClient, make_user: Any, fake: FakeBackend, limits: Callable[..., None]
) -> None:
    limits(end_user_requests_per_minute=2)
    _, key = await make_user("user")
    assert _statuses([await _send(client, key, "alice-hmac") for _ in range(2)]) == [200, 200]
    asked = len(fake.requests)
    refused = await _send(client, key, "alice-hmac")
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error == {
        "message": error["message"],
        "type": "rate_limit_error",
        "param": "end_user_requests_per_minute",
        "code": "end_user_rate_limit_exceeded",
    }
    assert "this end user: 2 requests per minute" in error["message"]
    assert "alice" not in refused.text  # the identifier is never echoed
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert len(fake.requests) == asked  # the refused request never reached the backend
    # the account's other end users and the account itself are not held back
    assert (await _send(client, key, "bob-hmac")).status_code == 200
    assert (await _send(client, key)).status_code == 200


async def test_an_end_user_past_its_token_limit_gets_429_naming_it_while_a_sibling_gets_200(
    client: httpx.AsyncClient, make_user: Any, fake: FakeBackend, limits: Callable[..., None]
) -> None:
    _, key = await make_user("user")
    probe = await _send(client, key, "probe")
    prompt = probe.json()["usage"]["prompt_tokens"]
    reserved = prompt + _chat()["max_tokens"]  # what a request reserves: prompt + n x max_tokens
    # one request fits; a second does not while the first's use (at least its prompt) counts
    limits(end_user_tokens_per_minute=reserved + prompt - 1)
    assert (await _send(client, key, "alice-hmac")).status_code == 200
    refused = await _send(client, key, "alice-hmac")
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "end_user_rate_limit_exceeded" and error["param"] == "end_user_tokens_per_minute"
    assert f"this end user: {reserved + prompt - 1} tokens per minute" in error["message"]
    assert "alice" not in refused.text and int(refused.headers["retry-after"]) >= 1
    assert (await _send(client, key, "bob-hmac")).status_code == 200
    assert (await _send(client, key)).status_code == 200


async def test_an_accounts_overrides_raise_and_lower_each_end_user_cap(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, fake: FakeBackend, limits: Callable[..., None]
) -> None:
    limits(end_users_max_per_account=2, end_users_new_per_minute=2)
    for field, setting in (
        ("end_users_max", "end_users_max_per_account"),
        ("end_users_new_per_minute", "end_users_new_per_minute"),
    ):
        account, key = await make_user("user")
        other = "end_users_new_per_minute" if field == "end_users_max" else "end_users_max"
        path = f"/admin/users/{account['id']}"
        assert (await client.patch(path, json={other: 0}, headers=_auth(admin_key))).status_code == 200  # unlimited
        patch = functools.partial(_patch, client, admin_key, path, field)
        await patch(1)  # lowered below the setting (2)
        assert (await _send(client, key, "a")).status_code == 200
        refused = await _send(client, key, "b")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "end_user_limit_exceeded" and f"this account's {field}" in error["message"]
        await patch(3)  # raised above it
        assert _statuses([await _send(client, key, name) for name in "bcd"]) == [200, 200, 429]
        await patch(None)  # back to the setting: 2, already reached
        back = await _send(client, key, "d")
        assert back.status_code == 429 and f"({setting})" in back.json()["error"]["message"]
        assert (await _send(client, key, "a")).status_code == 200  # known end users are never capped


async def test_an_accounts_overrides_raise_and_lower_each_end_user_rate_limit(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, fake: FakeBackend, limits: Callable[..., None]
) -> None:
    account, key = await make_user("user")
    path = f"/admin/users/{account['id']}"
    limits(end_user_requests_per_minute=2)
    patched = await client.patch(path, json={"end_user_requests_per_minute": 1}, headers=_auth(admin_key))
    assert patched.status_code == 200 and patched.json()["end_user_requests_per_minute"] == 1
    assert _statuses([await _send(client, key, "alice-hmac") for _ in range(2)]) == [200, 429]
    await client.patch(path, json={"end_user_requests_per_minute": 3}, headers=_auth(admin_key))
    # 1 of 3 taken this minute
    assert _statuses([await _send(client, key, "alice-hmac") for _ in range(3)]) == [200, 200, 429]
    # the end user's own limit comes before the account's: 0 is unlimited, null is the account's
    alice = (await client.get(f"{path}/end-users", headers=_auth(admin_key))).json()["data"][0]
    own = f"{path}/end-users/{alice['id']}"
    unlimited = await client.patch(own, json={"requests_per_minute": 0}, headers=_auth(admin_key))
    assert unlimited.status_code == 200, unlimited.text
    assert unlimited.json()["requests_per_minute"] == 0 and unlimited.json()["limits"]["requests_per_minute"] == 0
    assert (await _send(client, key, "alice-hmac")).status_code == 200
    await client.patch(own, json={"requests_per_minute": None}, headers=_auth(admin_key))
    assert (await _send(client, key, "alice-hmac")).status_code == 429

    limits(end_user_tokens_per_minute=100_000)
    await client.patch(path, json={"end_user_tokens_per_minute": 1}, headers=_auth(admin_key))  # lowered
    lowered = await _send(client, key, "alice-hmac")
    assert lowered.status_code == 429, lowered.text
    assert "more than this end user's limit of 1 tokens per minute" in lowered.json()["error"]["message"]
    limits(end_user_tokens_per_minute=1)
    await client.patch(path, json={"end_user_tokens_per_minute": 100_000}, headers=_auth(admin_key))  # raised
    assert (await _send(client, key, "alice-hmac")).status_code == 200
    assert (await _send(client, key, "bob-hmac")).status_code == 200  # under the account's, not the setting


async def test_bad_limits_are_422_in_the_envelope_and_change_nothing(
    client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, admin_key: str, fake: FakeBackend
) -> None:
    account, key = await make_user("user")
    assert (await _send(client, key, "alice-hmac")).status_code == 200
    path = f"/admin/users/{account['id']}"
    alice = (await client.get(f"{path}/end-users", headers=_auth(admin_key))).json()["data"][0]
    entries = await db_session.scalar(select(func.count()).select_from(RegistryAuditEntry))
    cases = [
        *((path, {field: -1}, field) for field in ("end_users_max", "end_users_new_per_minute")),
        *((path, {field: -1}, field) for field in ("end_user_requests_per_minute", "end_user_tokens_per_minute")),
        (path, {"end_user_tokens_per_minute": 2**31}, "end_user_tokens_per_minute"),
        (path, {"end_users_max": "many"}, "end_users_max"),
        *(
            (f"{path}/end-users/{alice['id']}", {field: -1}, field)
            for field in ("requests_per_minute", "tokens_per_minute")
        ),
        (f"{path}/end-users/{alice['id']}", {"parallel": 1}, "parallel"),
    ]
    for url, body, param in cases:
        response = await client.patch(url, json=body, headers=_auth(admin_key))
        assert response.status_code == 422, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    missing = await client.patch(f"{path}/end-users/999999", json={"requests_per_minute": 1}, headers=_auth(admin_key))
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "end_user_id"
    assert await db_session.scalar(select(func.count()).select_from(RegistryAuditEntry)) == entries


async def test_limit_changes_are_recorded_in_the_audit_trail(
    client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, admin_key: str, fake: FakeBackend
) -> None:
    account, key = await make_user("user")
    assert (await _send(client, key, "alice-hmac")).status_code == 200
    path = f"/admin/users/{account['id']}"
    alice = (await client.get(f"{path}/end-users", headers=_auth(admin_key))).json()["data"][0]
    changes = {"end_users_max": 10, "end_users_new_per_minute": 0, "end_user_requests_per_minute": 5}
    for _ in range(2):  # the second changes nothing and records nothing
        assert (await client.patch(path, json=changes, headers=_auth(admin_key))).status_code == 200
    back = {"end_users_max": None, "end_user_tokens_per_minute": 900}
    assert (await client.patch(path, json=back, headers=_auth(admin_key))).status_code == 200
    own = f"{path}/end-users/{alice['id']}"
    for _ in range(2):
        patched = await client.patch(own, json={"tokens_per_minute": 300}, headers=_auth(admin_key))
        assert patched.status_code == 200, patched.text
    entries = (
        await db_session.scalars(
            select(RegistryAuditEntry)
            .where(RegistryAuditEntry.action.in_(["user.update", "end_user.update"]))
            .order_by(RegistryAuditEntry.seq)
        )
    ).all()
    assert [(e.action, e.target_id, e.actor_name) for e in entries] == [
        ("user.update", str(account["id"]), "test-admin"),
        ("user.update", str(account["id"]), "test-admin"),
        ("end_user.update", str(alice["id"]), "test-admin"),
    ]
    assert entries[0].changes == {
        "before": {"end_users_max": None, "end_users_new_per_minute": None, "end_user_requests_per_minute": None},
        "after": changes,
    }
    assert entries[1].changes == {
        "before": {"end_users_max": 10, "end_user_tokens_per_minute": None},
        "after": back,
    }
    assert entries[2].changes == {
        "before": {"tokens_per_minute": None},
        "after": {"tokens_per_minute": 300, "user_id": account["id"], "identifier": "alice-hmac"},
    }
    listed = await client.get("/admin/audit", params={"action": "end_user.update"}, headers=_auth(admin_key))
    assert listed.status_code == 200 and [e["target"]["id"] for e in listed.json()["data"]] == [str(alice["id"])]
    verified = await client.get("/admin/audit", params={"limit": 500}, headers=_auth(admin_key))
    assert verified.status_code == 200


async def test_the_admin_api_shows_each_end_users_limits_and_usage(
    app: Any, client: httpx.AsyncClient, make_user: Any, admin_key: str, fake: FakeBackend
) -> None:
    account, key = await make_user("user")
    spent: dict[str, list[int]] = {"alice-hmac": [0, 0], "bob-hmac": [0, 0]}
    for identifier, n in (("alice-hmac", 1), ("alice-hmac", 1), ("bob-hmac", 2)):
        response = await _send(client, key, identifier, n=n)
        assert response.status_code == 200, response.text
        spent[identifier][0] += 1
        spent[identifier][1] += response.json()["usage"]["total_tokens"]
    assert (await _send(client, key)).status_code == 200  # the account's own: no end user's usage
    path = f"/admin/users/{account['id']}"
    patched = await client.patch(path, json={"end_user_tokens_per_minute": 7000}, headers=_auth(admin_key))
    assert patched.json()["end_user_tokens_per_minute"] == 7000
    page = (await client.get(f"{path}/end-users", headers=_auth(admin_key))).json()
    alice, bob = page["data"]
    own = await client.patch(
        f"{path}/end-users/{alice['id']}", json={"requests_per_minute": 9}, headers=_auth(admin_key)
    )
    alice = own.json()
    settings = app.state.resources.settings
    assert alice["requests_per_minute"] == 9 and alice["tokens_per_minute"] is None
    assert alice["limits"] == {"requests_per_minute": 9, "tokens_per_minute": 7000}
    assert bob["requests_per_minute"] is None
    assert bob["limits"] == {"requests_per_minute": settings.end_user_requests_per_minute, "tokens_per_minute": 7000}
    for shown in (alice, bob):
        requests, tokens = spent[shown["identifier"]]
        assert (shown["usage"]["requests"], shown["usage"]["tokens"]) == (requests, tokens), shown
        assert shown["usage"]["since"]


# -- concurrent first sights: a database of their own, a real pool, requests at once -----------------


async def _started(settings: Settings) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", lambda s, metrics: FakeBackend(s.model_name))
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
                yield app, client


async def _race(settings: Settings) -> None:
    async for app, client in _started(settings):
        async with session_scope(app.state.resources.sessionmaker) as session:
            created = await UserService(
                Repositories(session), app.state.resources.keyring.spec, app.state.resources.api_key_hasher
            ).create_user("platform", Role.USER)
        for round_ in range(3):
            identifier = f"racing-{round_}"
            # every process's cache is empty for a new identifier: all 8 requests read the database
            responses = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=_chat(user=identifier), headers=_auth(created.api_key))
                    for _ in range(8)
                )
            )
            assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
            stamps = {str(stamp.message.bits) for _, stamp in app.state.resources.backend.requests[-8:]}
            async with session_scope(app.state.resources.sessionmaker) as session:
                rows = (await session.scalars(select(EndUser).where(EndUser.identifier == identifier))).all()
                assert len(rows) == 1
                ids = (await session.scalars(select(MessageId).where(MessageId.end_user_id == rows[0].id))).all()
                created_entries = await session.scalar(
                    select(func.count())
                    .select_from(RegistryAuditEntry)
                    .where(
                        RegistryAuditEntry.action == "end_user.create", RegistryAuditEntry.target_id == str(rows[0].id)
                    )
                )
            assert len(ids) == len({(m.bits, m.block_bits) for m in ids}) >= 1
            assert stamps <= {m.message_id for m in ids} and len(stamps) == 1
            assert created_entries == 1
            app.state.resources.end_users.cache.clear()


@pytest.mark.postgres
async def test_concurrent_first_requests_create_one_end_user_on_postgres(settings: Settings) -> None:
    async with own_database(settings, "xmark_end_users") as url:
        await _race(settings.model_copy(update={"database_url": url}))


async def test_concurrent_first_requests_create_one_end_user_on_sqlite(tmp_path: Any) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'var' / 'xmark.db'}"
    (tmp_path / "var").mkdir()
    await asyncio.to_thread(upgrade_database, url)
    await _race(make_test_settings(tmp_path / "var", database_url=url))
