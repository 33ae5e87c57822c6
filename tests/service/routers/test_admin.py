"""Admin API: users, API keys, tombstones, key versions."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import ApiKey, User

KEY_RE = re.compile(r"^xm_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}$")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _create(client: httpx.AsyncClient, admin_key: str, name: str, role: str = "user") -> dict[str, Any]:
    response = await client.post("/admin/users", json={"name": name, "role": role}, headers=bearer(admin_key))
    assert response.status_code == 201, response.text
    return response.json()


async def test_create_user_returns_the_fixed_contract(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    body = await _create(client, admin_key, "alice", "auditor")
    assert set(body) == {
        "id",
        "name",
        "role",
        "message_id",
        "message_ids",
        "max_parallel_requests",
        "requests_per_minute",
        "tokens_per_minute",
        "api_key",
    }
    # no limit given: each takes the gateway's default
    assert body["max_parallel_requests"] is body["requests_per_minute"] is body["tokens_per_minute"] is None
    assert body["name"] == "alice"
    assert body["role"] == "auditor"
    # new deployments use 64-bit message IDs: the test versions were registered with the defaults
    assert re.fullmatch(r"[01]{64}", body["message_id"])
    assert body["message_ids"] == [{"bits": 64, "block_bits": 2, "message_id": body["message_id"]}]
    assert KEY_RE.match(body["api_key"])

    key_row = (await db_session.scalars(select(ApiKey).where(ApiKey.user_id == body["id"]))).one()
    assert key_row.key_hash != body["api_key"]
    assert re.fullmatch(r"[0-9a-f]{64}", key_row.key_hash)
    assert body["api_key"].startswith(key_row.prefix)
    assert len(key_row.prefix) < 16
    for column in ApiKey.__table__.columns:
        assert getattr(key_row, column.key) != body["api_key"]

    # the plaintext is never shown again
    listed = await client.get(f"/admin/users/{body['id']}/keys", headers=bearer(admin_key))
    fetched = await client.get(f"/admin/users/{body['id']}", headers=bearer(admin_key))
    for response in (listed, fetched):
        assert response.status_code == 200
        assert body["api_key"] not in response.text
        assert key_row.key_hash not in response.text


async def test_a_new_key_authenticates_its_user(client: httpx.AsyncClient, admin_key: str) -> None:
    auditor = await _create(client, admin_key, "auditor-1", "auditor")
    response = await client.get("/admin/users", headers=bearer(auditor["api_key"]))
    assert response.status_code == 403  # authenticated, wrong role
    assert response.json()["error"]["type"] == "permission_error"


async def test_users_are_listed_in_pages(client: httpx.AsyncClient, admin_key: str) -> None:
    for i in range(4):
        await _create(client, admin_key, f"user-{i}")
    first = (await client.get("/admin/users?limit=2", headers=bearer(admin_key))).json()
    second = (await client.get("/admin/users?limit=2&offset=2", headers=bearer(admin_key))).json()
    third = (await client.get("/admin/users?limit=2&offset=4", headers=bearer(admin_key))).json()
    assert first["total"] == second["total"] == third["total"] == 5  # 4 users and the admin
    assert [len(p["data"]) for p in (first, second, third)] == [2, 2, 1]
    assert first["has_more"] and second["has_more"] and not third["has_more"]
    ids = [u["id"] for p in (first, second, third) for u in p["data"]]
    assert ids == sorted(ids) and len(set(ids)) == 5
    # keyset paging gives the same pages; total counts the matches after the cursor
    after, keyset = 0, []
    while True:
        page = (await client.get(f"/admin/users?limit=2&after_id={after}", headers=bearer(admin_key))).json()
        keyset.append(page)
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert [u["id"] for p in keyset for u in p["data"]] == ids
    assert [p["total"] for p in keyset] == [5, 3, 1]
    refused = await client.get("/admin/users?after_id=-1", headers=bearer(admin_key))
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "after_id"
    admins = (await client.get("/admin/users?role=admin", headers=bearer(admin_key))).json()
    assert [u["name"] for u in admins["data"]] == ["test-admin"]
    for page in (first, second, third):
        for user in page["data"]:
            assert "api_key" not in user


async def test_get_missing_user_is_404(client: httpx.AsyncClient, admin_key: str) -> None:
    response = await client.get("/admin/users/999999", headers=bearer(admin_key))
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


async def test_disable_and_enable(client: httpx.AsyncClient, admin_key: str) -> None:
    user = await _create(client, admin_key, "bob", "admin")
    headers = bearer(user["api_key"])
    assert (await client.get("/admin/users", headers=headers)).status_code == 200

    disabled = await client.post(f"/admin/users/{user['id']}/disable", headers=bearer(admin_key))
    assert disabled.status_code == 200 and disabled.json()["status"] == "disabled"
    refused = await client.get("/admin/users", headers=headers)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "user_disabled"

    enabled = await client.post(f"/admin/users/{user['id']}/enable", headers=bearer(admin_key))
    assert enabled.status_code == 200 and enabled.json()["status"] == "active"
    assert (await client.get("/admin/users", headers=headers)).status_code == 200


async def test_delete_keeps_a_tombstone_and_revokes_keys(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    user = await _create(client, admin_key, "carol", "admin")
    extra = await client.post(f"/admin/users/{user['id']}/keys", headers=bearer(admin_key))
    assert extra.status_code == 201

    deleted = await client.delete(f"/admin/users/{user['id']}", headers=bearer(admin_key))
    assert deleted.status_code == 200
    tomb = deleted.json()
    assert tomb["status"] == "deleted" and tomb["deleted_at"] is not None
    assert tomb["message_id"] == user["message_id"] and tomb["message_ids"] == user["message_ids"]

    again = await client.get(f"/admin/users/{user['id']}", headers=bearer(admin_key))
    assert again.status_code == 200 and again.json()["status"] == "deleted"
    keys = (await client.get(f"/admin/users/{user['id']}/keys", headers=bearer(admin_key))).json()
    assert len(keys["data"]) == 2 and all(k["revoked_at"] for k in keys["data"])
    for key in (user["api_key"], extra.json()["api_key"]):
        assert (await client.get("/admin/users", headers=bearer(key))).status_code == 401

    row = await db_session.get(User, user["id"])
    assert row is not None and row.status == "deleted" and row.message_id == user["message_id"]

    for action in ("enable", "disable"):
        response = await client.post(f"/admin/users/{user['id']}/{action}", headers=bearer(admin_key))
        assert response.status_code == 409
    refused = await client.post(f"/admin/users/{user['id']}/keys", headers=bearer(admin_key))
    assert refused.status_code == 409


async def test_last_active_admin_cannot_be_disabled_or_deleted(client: httpx.AsyncClient, admin_key: str) -> None:
    users = (await client.get("/admin/users?role=admin", headers=bearer(admin_key))).json()
    (admin,) = users["data"]
    for method, path in (("POST", f"/admin/users/{admin['id']}/disable"), ("DELETE", f"/admin/users/{admin['id']}")):
        response = await client.request(method, path, headers=bearer(admin_key))
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "last_admin"


async def test_keys_are_issued_listed_and_revoked(client: httpx.AsyncClient, admin_key: str) -> None:
    user = await _create(client, admin_key, "dave", "admin")
    issued = await client.post(f"/admin/users/{user['id']}/keys", headers=bearer(admin_key))
    assert issued.status_code == 201
    body = issued.json()
    assert {"id", "api_key"} <= set(body)
    assert KEY_RE.match(body["api_key"]) and body["api_key"] != user["api_key"]

    listed = (await client.get(f"/admin/users/{user['id']}/keys", headers=bearer(admin_key))).json()
    assert [k["id"] for k in listed["data"]] == sorted(k["id"] for k in listed["data"])
    for key in listed["data"]:
        assert set(key) == {"id", "user_id", "prefix", "created_at", "last_used_at", "revoked_at"}
        assert KEY_RE.match(key["prefix"]) is None

    revoked = await client.post(f"/admin/users/{user['id']}/keys/{body['id']}/revoke", headers=bearer(admin_key))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    refused = await client.get("/admin/users", headers=bearer(body["api_key"]))
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    # the user's other key still works
    assert (await client.get("/admin/users", headers=bearer(user["api_key"]))).status_code == 200

    other = await _create(client, admin_key, "erin")
    wrong_owner = await client.post(f"/admin/users/{other['id']}/keys/{body['id']}/revoke", headers=bearer(admin_key))
    assert wrong_owner.status_code == 404


async def test_the_admins_last_key_cannot_be_revoked(client: httpx.AsyncClient, admin_key: str) -> None:
    (admin,) = (await client.get("/admin/users?role=admin", headers=bearer(admin_key))).json()["data"]
    (only,) = (await client.get(f"/admin/users/{admin['id']}/keys", headers=bearer(admin_key))).json()["data"]
    path = f"/admin/users/{admin['id']}/keys/{only['id']}/revoke"
    refused = await client.post(path, headers=bearer(admin_key))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "last_admin_key"
    assert (await client.get("/admin/users", headers=bearer(admin_key))).status_code == 200
    # an admin's second key makes the first revocable; then the second is the last
    spare = (await client.post(f"/admin/users/{admin['id']}/keys", headers=bearer(admin_key))).json()
    assert (await client.post(path, headers=bearer(spare["api_key"]))).status_code == 200
    assert (await client.get("/admin/users", headers=bearer(admin_key))).status_code == 401
    last = await client.post(f"/admin/users/{admin['id']}/keys/{spare['id']}/revoke", headers=bearer(spare["api_key"]))
    assert last.status_code == 409 and last.json()["error"]["code"] == "last_admin_key"
    # a key of a disabled admin does not count: it opens nothing
    other = await _create(client, spare["api_key"], "frank", "admin")
    disabled = await client.post(f"/admin/users/{other['id']}/disable", headers=bearer(spare["api_key"]))
    assert disabled.status_code == 200
    last = await client.post(f"/admin/users/{admin['id']}/keys/{spare['id']}/revoke", headers=bearer(spare["api_key"]))
    assert last.status_code == 409
    # a user's (not an admin's) last key is revoked as always
    user = await _create(client, spare["api_key"], "gina")
    (key,) = (await client.get(f"/admin/users/{user['id']}/keys", headers=bearer(spare["api_key"]))).json()["data"]
    revoked = await client.post(f"/admin/users/{user['id']}/keys/{key['id']}/revoke", headers=bearer(spare["api_key"]))
    assert revoked.status_code == 200


async def test_last_used_is_recorded(client: httpx.AsyncClient, admin_key: str) -> None:
    users = (await client.get("/admin/users?role=admin", headers=bearer(admin_key))).json()
    admin_id = users["data"][0]["id"]
    keys = (await client.get(f"/admin/users/{admin_id}/keys", headers=bearer(admin_key))).json()
    assert keys["data"][0]["last_used_at"] is not None


async def test_key_versions_list_activate_retire(app: Any, client: httpx.AsyncClient, admin_key: str) -> None:
    listed = (await client.get("/admin/key-versions", headers=bearer(admin_key))).json()["data"]
    by_name = {v["name"]: v for v in listed}
    assert by_name["v1"]["status"] == "active" and by_name["v2"]["status"] == "pending"
    for version in listed:
        assert re.fullmatch(r"[0-9a-f]{64}", version["fingerprint"])
        assert version["configured"] is True
        assert (version["bits"], version["block_bits"], version["num_keys"]) == (64, 2, 4)
    assert app.state.resources.keyring.active().name == "v1"

    added = await client.post("/admin/key-versions", json={"name": "v2"}, headers=bearer(admin_key))
    assert added.status_code == 201, added.text
    assert added.json()["status"] == "active"
    assert app.state.resources.keyring.active().name == "v2"
    assert {h.name for h in app.state.resources.keyring.usable()} == {"v1", "v2"}

    again = await client.post("/admin/key-versions", json={"name": "v2"}, headers=bearer(admin_key))
    assert again.status_code == 409

    retired = await client.post(f"/admin/key-versions/{by_name['v1']['id']}/retire", headers=bearer(admin_key))
    assert retired.status_code == 200 and retired.json()["status"] == "retired"
    assert [h.name for h in app.state.resources.keyring.usable()] == ["v2"]

    last = await client.post(f"/admin/key-versions/{by_name['v2']['id']}/retire", headers=bearer(admin_key))
    assert last.status_code == 409
    assert last.json()["error"]["code"] == "last_active_key_version"

    revived = await client.post("/admin/key-versions", json={"name": "v1"}, headers=bearer(admin_key))
    assert revived.status_code == 409


async def test_key_version_without_configured_secret_is_refused(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    response = await client.post("/admin/key-versions", json={"name": "v9"}, headers=bearer(admin_key))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "name" and error["code"] == "secret_not_configured"
    missing = await client.post("/admin/key-versions/999999/retire", headers=bearer(admin_key))
    assert missing.status_code == 404


async def test_key_versions_are_restored_after_a_rolled_back_test(app: Any) -> None:
    # runs after the activation test: the rollback and keyring refresh undo its changes
    assert app.state.resources.keyring.active().name == "v1"
    assert {h.name: h.status for h in app.state.resources.keyring.usable()} == {"v1": "active", "v2": "pending"}


async def test_admin_writes_nothing_on_refusal(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    before = await db_session.scalar(select(func.count()).select_from(User))
    bad = await client.post("/admin/users", json={"name": "x", "role": "root"}, headers=bearer(admin_key))
    assert bad.status_code == 422
    assert await db_session.scalar(select(func.count()).select_from(User)) == before


@pytest.mark.parametrize("name", ["", "   ", "a" * 201, "tab\tname"])
async def test_bad_user_names_are_rejected(client: httpx.AsyncClient, admin_key: str, name: str) -> None:
    response = await client.post("/admin/users", json={"name": name}, headers=bearer(admin_key))
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "name"


# -- per-user limits and other changes (PATCH) --------------------------------------------------


async def test_limits_are_set_at_creation_and_changed_or_cleared_later(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    limits = {"max_parallel_requests": 2, "requests_per_minute": 0, "tokens_per_minute": 5000}
    created = await client.post("/admin/users", json={"name": "limited", **limits}, headers=bearer(admin_key))
    assert created.status_code == 201, created.text
    user_id = created.json()["id"]
    assert {k: created.json()[k] for k in limits} == limits
    fetched = (await client.get(f"/admin/users/{user_id}", headers=bearer(admin_key))).json()
    assert {k: fetched[k] for k in limits} == limits

    # only the fields sent change; null goes back to the default
    patched = await client.patch(
        f"/admin/users/{user_id}",
        json={"requests_per_minute": 30, "tokens_per_minute": None},
        headers=bearer(admin_key),
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert (body["max_parallel_requests"], body["requests_per_minute"], body["tokens_per_minute"]) == (2, 30, None)
    row = await db_session.get(User, user_id)
    assert row is not None
    await db_session.refresh(row)
    assert (row.max_parallel_requests, row.requests_per_minute, row.tokens_per_minute) == (2, 30, None)
    listed = (await client.get("/admin/users?limit=500", headers=bearer(admin_key))).json()["data"]
    assert next(u for u in listed if u["id"] == user_id)["requests_per_minute"] == 30


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"requests_per_minute": -1}, "requests_per_minute"),
        ({"tokens_per_minute": 1.5}, "tokens_per_minute"),
        ({"max_parallel_requests": "many"}, "max_parallel_requests"),
        ({"max_parallel_requests": 2**31}, "max_parallel_requests"),
        ({"role": None}, "role"),
        ({"name": None}, "name"),
        ({"role": "root"}, "role"),
        ({"quota": 5}, "quota"),
    ],
)
async def test_bad_changes_are_422_naming_the_field(
    client: httpx.AsyncClient, admin_key: str, body: dict[str, Any], param: str
) -> None:
    user = await _create(client, admin_key, "to-change")
    for method, path, payload in (
        ("PATCH", f"/admin/users/{user['id']}", body),
        ("POST", "/admin/users", {"name": "new-user", **body}),
    ):
        if method == "POST" and param in {"role", "name"}:
            continue  # null or a bad role at creation are covered above
        response = await client.request(method, path, json=payload, headers=bearer(admin_key))
        assert response.status_code == 422, (method, response.text)
        assert response.json()["error"]["param"] == param


async def test_a_change_applies_to_the_users_next_request(
    app: Any, client: httpx.AsyncClient, admin_key: str, make_user: Any
) -> None:
    principal, key = await make_user("user")
    authenticator = app.state.resources.authenticator
    first = await authenticator.authenticate(f"Bearer {key}")  # cached from here on
    assert first.requests_per_minute is None
    patched = await client.patch(
        f"/admin/users/{principal['id']}",
        json={"requests_per_minute": 7, "max_parallel_requests": 0, "name": "renamed"},
        headers=bearer(admin_key),
    )
    assert patched.status_code == 200, patched.text
    after = await authenticator.authenticate(f"Bearer {key}")
    assert (after.requests_per_minute, after.max_parallel_requests, after.name) == (7, 0, "renamed")


async def test_role_changes_apply_at_once_and_spare_the_last_admin(
    client: httpx.AsyncClient, admin_key: str, make_user: Any
) -> None:
    principal, key = await make_user("user")
    assert (await client.get("/admin/users", headers=bearer(key))).status_code == 403
    promoted = await client.patch(f"/admin/users/{principal['id']}", json={"role": "admin"}, headers=bearer(admin_key))
    assert promoted.status_code == 200 and promoted.json()["role"] == "admin"
    assert (await client.get("/admin/users", headers=bearer(key))).status_code == 200
    # two active admins: one may demote the other, but not the last one
    admins = (await client.get("/admin/users?role=admin&status=active", headers=bearer(key))).json()["data"]
    first = next(u for u in admins if u["id"] != principal["id"])
    demoted = await client.patch(f"/admin/users/{first['id']}", json={"role": "auditor"}, headers=bearer(key))
    assert demoted.status_code == 200
    assert (await client.get("/admin/users", headers=bearer(admin_key))).status_code == 403
    last = await client.patch(f"/admin/users/{principal['id']}", json={"role": "user"}, headers=bearer(key))
    assert last.status_code == 409 and last.json()["error"]["code"] == "last_admin"
    # a change that keeps the role is no role change
    same = await client.patch(f"/admin/users/{principal['id']}", json={"role": "admin"}, headers=bearer(key))
    assert same.status_code == 200


async def test_deleted_or_missing_users_cannot_be_changed(client: httpx.AsyncClient, admin_key: str) -> None:
    user = await _create(client, admin_key, "gone")
    assert (await client.delete(f"/admin/users/{user['id']}", headers=bearer(admin_key))).status_code == 200
    refused = await client.patch(
        f"/admin/users/{user['id']}", json={"requests_per_minute": 1}, headers=bearer(admin_key)
    )
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "user_deleted"
    missing = await client.patch("/admin/users/999999", json={"requests_per_minute": 1}, headers=bearer(admin_key))
    assert missing.status_code == 404
