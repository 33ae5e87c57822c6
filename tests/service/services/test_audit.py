"""The registry's audit trail: every admin change appears once, with its actor, target, fields
before and after and request id, in the unit of work of the change (a change that fails or rolls
back leaves none; an entry that cannot be written fails the change); GET /admin/audit reads it;
concurrent changes on PostgreSQL and SQLite give one gapless, verifiable chain."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import SecretStr
from sqlalchemy import delete, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession

import service.resources
from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.app import create_app
from service.cli.verify_audit import check_trail
from service.config import Settings
from service.db import session_scope, upgrade_database
from service.models import ApiKey, RegistryAuditEntry, RegistryAuditHead, User
from service.repositories.unit import Repositories
from service.security import generate_api_key
from service.services.audit import (
    GENESIS_HASH,
    UNSIGNED_FIELDS,
    Actor,
    AuditTrail,
    ChainVerifier,
    entry_hash,
    stored_entry,
)
from service.services.reports import canonical_json
from service.services.users import UserService
from service.vocabulary import Role
from tests.fakes import FakeBackend


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _head(session: AsyncSession) -> tuple[int, str]:
    row = (await session.execute(select(RegistryAuditHead.seq, RegistryAuditHead.entry_hash))).one()
    return int(row[0]), str(row[1])


async def _entries(session: AsyncSession, after_seq: int = 0) -> list[RegistryAuditEntry]:
    stmt = select(RegistryAuditEntry).where(RegistryAuditEntry.seq > after_seq).order_by(RegistryAuditEntry.seq)
    return list((await session.scalars(stmt)).all())


def _signed_correctly(entry: dict[str, Any], public_key: bytes) -> bool:
    """An entry as the API serves it: its hash is the payload's, its signature the gateway's."""
    payload = {name: value for name, value in entry.items() if name not in UNSIGNED_FIELDS}
    if entry_hash(payload) != entry["entry_hash"]:
        return False
    Ed25519PublicKey.from_public_bytes(public_key).verify(base64.b64decode(entry["signature"]), canonical_json(payload))
    return True


async def _whole_chain_verifies(session: AsyncSession, public_key: bytes) -> int:
    verifier = ChainVerifier([public_key])
    for row in await _entries(session):
        problem = verifier.add(stored_entry(row))
        assert problem is None, str(problem)
    problem = verifier.close(await _head(session))
    assert problem is None, str(problem)
    return verifier.count


async def test_every_admin_route_is_recorded_once_with_who_what_and_the_request(
    app: Any, client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    admin = (await client.get("/me", headers=bearer(admin_key))).json()
    start, _ = await _head(db_session)
    H = bearer(admin_key)
    done: list[tuple[httpx.Response, str, str, str]] = []  # response, action, target type, target id

    created = await client.post("/admin/users", json={"name": "alice", "requests_per_minute": 60}, headers=H)
    assert created.status_code == 201, created.text
    alice = created.json()
    done.append((created, "user.create", "user", str(alice["id"])))
    path = f"/admin/users/{alice['id']}"
    for response, action in (
        (
            await client.patch(
                path, json={"name": "alice-b", "role": "auditor", "requests_per_minute": None}, headers=H
            ),
            "user.update",
        ),
        (await client.post(f"{path}/disable", headers=H), "user.disable"),
        (await client.post(f"{path}/enable", headers=H), "user.enable"),
    ):
        assert response.status_code == 200, response.text
        done.append((response, action, "user", str(alice["id"])))
    issued = await client.post(f"{path}/keys", headers=H)
    assert issued.status_code == 201, issued.text
    key = issued.json()
    done.append((issued, "api_key.issue", "api_key", str(key["id"])))
    revoked = await client.post(f"{path}/keys/{key['id']}/revoke", headers=H)
    assert revoked.status_code == 200, revoked.text
    done.append((revoked, "api_key.revoke", "api_key", str(key["id"])))
    deleted = await client.delete(path, headers=H)
    assert deleted.status_code == 200, deleted.text
    done.append((deleted, "user.delete", "user", str(alice["id"])))
    activated = await client.post("/admin/key-versions", json={"name": "v2"}, headers=H)
    assert activated.status_code == 201, activated.text
    v2 = activated.json()
    done.append((activated, "key_version.activate", "key_version", str(v2["id"])))
    retired = await client.post(f"/admin/key-versions/{v2['id']}/retire", headers=H)
    assert retired.status_code == 200, retired.text
    done.append((retired, "key_version.retire", "key_version", str(v2["id"])))

    rows = await _entries(db_session, start)
    assert [(r.action, r.target_type, r.target_id) for r in rows] == [d[1:] for d in done]
    assert [r.seq for r in rows] == list(range(start + 1, start + 1 + len(done)))
    for row, (response, *_) in zip(rows, done, strict=True):
        assert (row.actor_kind, row.actor_user_id, row.actor_name) == ("api", admin["user_id"], "test-admin")
        assert row.request_id == response.headers["x-request-id"]
        assert row.created_at.tzinfo is not None and abs(datetime.now(UTC) - row.created_at) < timedelta(minutes=5)
    changes = {r.action: r.changes for r in rows}
    first_key = (
        await db_session.scalars(select(ApiKey).where(ApiKey.user_id == alice["id"]).order_by(ApiKey.id))
    ).first()
    assert first_key is not None
    assert changes["user.create"]["before"] is None
    after = changes["user.create"]["after"]
    assert {k: after[k] for k in ("name", "role", "status", "requests_per_minute", "tokens_per_minute")} == {
        "name": "alice",
        "role": "user",
        "status": "active",
        "requests_per_minute": 60,
        "tokens_per_minute": None,
    }
    assert after["message_ids"] == alice["message_ids"]
    assert after["api_key"] == {"id": first_key.id, "prefix": first_key.prefix}
    assert changes["user.update"] == {
        "before": {"name": "alice", "role": "user", "requests_per_minute": 60},
        "after": {"name": "alice-b", "role": "auditor", "requests_per_minute": None},
    }
    assert changes["user.disable"] == {"before": {"status": "active"}, "after": {"status": "disabled"}}
    assert changes["user.enable"] == {"before": {"status": "disabled"}, "after": {"status": "active"}}
    assert changes["api_key.issue"] == {"before": None, "after": {"user_id": alice["id"], "prefix": key["prefix"]}}
    named = {"user_id": alice["id"], "prefix": key["prefix"]}
    assert changes["api_key.revoke"]["before"] == {**named, "revoked_at": None}
    assert changes["api_key.revoke"]["after"]["revoked_at"].endswith("Z")
    # deleting revokes the keys still live: only the first one (the issued one was revoked already)
    assert changes["user.delete"]["before"] == {"status": "active"}
    assert changes["user.delete"]["after"]["status"] == "deleted"
    assert changes["user.delete"]["after"]["revoked_api_keys"] == [{"id": first_key.id, "prefix": first_key.prefix}]
    assert changes["key_version.activate"]["before"] == {"status": "pending"}
    activation = changes["key_version.activate"]["after"]
    assert (activation["name"], activation["status"], activation["message_ids_added"]) == ("v2", "active", 0)
    assert activation["params"]["bits"] == v2["bits"] and "fingerprint" not in json.dumps(activation)
    assert changes["key_version.retire"]["before"] == {"name": "v2", "status": "active"}
    assert changes["key_version.retire"]["after"]["status"] == "retired"

    # never a key, its hash, a fingerprint or a secret, anywhere in an entry
    key_rows = (await db_session.scalars(select(ApiKey).where(ApiKey.user_id == alice["id"]))).all()
    text = json.dumps([stored_entry(r) for r in rows])
    forbidden = [alice["api_key"], key["api_key"], admin_key, v2["fingerprint"], *(k.key_hash for k in key_rows)]
    for value in forbidden:
        assert value not in text

    # the whole trail (start-up entries included) is one intact chain signed by the report key
    assert await _whole_chain_verifies(db_session, app.state.resources.report_signer.public_key) >= len(done)


async def test_changes_that_change_nothing_or_fail_are_not_recorded(
    app: Any, client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    H = bearer(admin_key)
    user = (await client.post("/admin/users", json={"name": "bob"}, headers=H)).json()
    path = f"/admin/users/{user['id']}"
    assert (await client.post(f"{path}/disable", headers=H)).status_code == 200
    gone = (await client.post("/admin/users", json={"name": "gone"}, headers=H)).json()
    assert (await client.delete(f"/admin/users/{gone['id']}", headers=H)).status_code == 200
    start = await _head(db_session)
    attempts = [
        # nothing to change: no entry
        ("POST", f"{path}/disable", None, 200),
        ("PATCH", path, {"name": "bob"}, 200),
        # refused before or after the service started: no entry
        ("POST", "/admin/users/999999/disable", None, 404),
        ("POST", f"/admin/users/{user['id']}/keys/999999/revoke", None, 404),
        ("POST", "/admin/key-versions/999999/retire", None, 404),
        ("PATCH", path, {"role": "root"}, 422),
        ("PATCH", f"/admin/users/{gone['id']}", {"name": "back"}, 409),  # read and refused under the lock
        ("POST", f"/admin/users/{gone['id']}/keys", None, 409),
        ("POST", "/admin/key-versions", {"name": "v9"}, 400),  # no secret configured
    ]
    for method, url, body, status in attempts:
        response = await client.request(method, url, json=body, headers=H)
        assert response.status_code == status, (url, response.text)
    assert await _head(db_session) == start
    assert await _entries(db_session, start[0]) == []


async def test_an_entry_rolls_back_with_its_change(app: Any, db_session: AsyncSession) -> None:
    resources = app.state.resources
    start = await _head(db_session)
    trail = AuditTrail(resources.report_signer, Actor.api(1, "someone"), "req-1")

    class Abort(Exception):
        pass

    with pytest.raises(Abort):
        async with session_scope(resources.sessionmaker) as session:
            service = UserService(Repositories(session), resources.keyring.spec, resources.api_key_hasher, audit=trail)
            await service.create_user("rolled-back", Role.USER)
            assert (await _head(session))[0] == start[0] + 1  # written, not yet committed
            raise Abort
    assert await _head(db_session) == start
    assert await _entries(db_session, start[0]) == []
    assert await db_session.scalar(select(func.count()).select_from(User).where(User.name == "rolled-back")) == 0


async def test_a_change_whose_entry_cannot_be_written_fails(
    client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    await db_session.execute(delete(RegistryAuditHead))  # (the test's transaction: rolled back after it)
    response = await client.post("/admin/users", json={"name": "unrecorded"}, headers=bearer(admin_key))
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "audit_trail_unavailable" and "nothing was changed" in error["message"]
    assert await db_session.scalar(select(func.count()).select_from(User).where(User.name == "unrecorded")) == 0


async def test_the_audit_route_pages_filters_and_serves_verifiable_entries(
    app: Any, client: httpx.AsyncClient, admin_key: str, make_user: Any, db_session: AsyncSession
) -> None:
    H = bearer(admin_key)
    start, _ = await _head(db_session)
    names = [f"page-{i}" for i in range(5)]
    ids = []
    for name in names:
        created = await client.post("/admin/users", json={"name": name}, headers=H)
        ids.append(created.json()["id"])
    assert (await client.post(f"/admin/users/{ids[0]}/disable", headers=H)).status_code == 200
    _, auditor_key = await make_user("auditor")
    _, user_key = await make_user("user")

    # keyset pages, oldest first from a cursor, then newest first
    seen: list[int] = []
    after: int | None = start
    while after is not None:
        page = await client.get("/admin/audit", params={"after_seq": after, "limit": 2}, headers=bearer(auditor_key))
        assert page.status_code == 200, page.text
        body = page.json()
        seen += [e["seq"] for e in body["data"]]
        after = body["next_after_seq"]
        assert body["has_more"] == (after is not None)
    assert seen == list(range(start + 1, start + 7))
    newest = (await client.get("/admin/audit", params={"order": "desc", "limit": 3}, headers=H)).json()
    assert [e["seq"] for e in newest["data"]] == [start + 6, start + 5, start + 4]
    older = await client.get(
        "/admin/audit", params={"order": "desc", "limit": 3, "after_seq": newest["next_after_seq"]}, headers=H
    )
    assert [e["seq"] for e in older.json()["data"]] == [start + 3, start + 2, start + 1]
    assert newest["head"] == {"seq": start + 6, "entry_hash": newest["data"][0]["entry_hash"]}

    # filters
    async def seqs(**params: Any) -> list[int]:
        response = await client.get("/admin/audit", params={"after_seq": start, **params}, headers=H)
        assert response.status_code == 200, response.text
        return [e["seq"] for e in response.json()["data"]]

    assert await seqs(action="user.disable") == [start + 6]
    assert await seqs(action="user.create") == list(range(start + 1, start + 6))
    assert await seqs(target_type="user", target_id=str(ids[0])) == [start + 1, start + 6]
    admin_id = (await client.get("/me", headers=H)).json()["user_id"]
    assert await seqs(actor_user_id=admin_id) == list(range(start + 1, start + 7))
    assert await seqs(actor_user_id=999999) == []
    now = datetime.now(UTC)
    assert await seqs(
        since=(now - timedelta(minutes=5)).isoformat(), until=(now + timedelta(minutes=5)).isoformat()
    ) == list(range(start + 1, start + 7))
    assert await seqs(since=(now + timedelta(minutes=5)).isoformat()) == []

    # each entry verifies from the API's own document, with the published key
    published = (await client.get("/.well-known/xmark-report-key")).json()
    public_key = base64.b64decode(published["public_key"])
    entries = (await client.get("/admin/audit", params={"after_seq": start}, headers=H)).json()["data"]
    assert all(_signed_correctly(e, public_key) for e in entries)
    assert entries[0]["prev_hash"] != GENESIS_HASH or entries[0]["seq"] == 1
    assert [e["prev_hash"] for e in entries[1:]] == [e["entry_hash"] for e in entries[:-1]]
    assert entries[0]["key_id"] == published["key_id"]

    # roles and bad input: the OpenAI envelope, naming the parameter
    refused = await client.get("/admin/audit", headers=bearer(user_key))
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    for params, status, param in (
        ({"limit": 501}, 422, "limit"),
        ({"action": "user.explode"}, 422, "action"),
        ({"after_seq": -1}, 422, "after_seq"),
        ({"order": "sideways"}, 422, "order"),
        ({"since": "yesterday"}, 422, "since"),
        ({"since": now.isoformat(), "until": (now - timedelta(days=1)).isoformat()}, 400, "until"),
    ):
        response = await client.get("/admin/audit", params=params, headers=H)
        assert response.status_code == status, (params, response.text)
        assert response.json()["error"]["param"] == param


# --- concurrency ---------------------------------------------------------------------------------

ROUNDS = 12


def _own_settings(settings: Settings, database_url: str, var_dir: Path, admin_key: str) -> Settings:
    return settings.model_copy(
        update={
            "database_url": database_url,
            "var_dir": var_dir,
            "watermark_secrets": SecretStr(f"v1:{secrets.token_hex(24)},v2:{secrets.token_hex(24)}"),
            "bootstrap_admin_key": SecretStr(admin_key),
            "database_pool_size": 8,
        }
    )


async def _started(settings: Settings) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", lambda s, metrics: FakeBackend(s.model_name))
        app = create_app(settings)
        transport = httpx.ASGITransport(app=app)
        # (60 s: 5x margin and more, a round of concurrent changes took well under a second here)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client,
        ):
            yield app, client


@pytest.fixture
async def postgres_app(
    settings: Settings, migrated_database: str, tmp_path: Path
) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    """An app on a fresh PostgreSQL database of its own (a real pool, each request its own transaction)."""
    name = f"{make_url(settings.database_url).database}_audit_{os.getpid()}"
    database_url = sibling_url(settings.database_url, name)
    await create_database(database_url, replace=True)
    try:
        await asyncio.to_thread(upgrade_database, database_url)
        admin_key = generate_api_key().plaintext
        async for app, client in _started(_own_settings(settings, database_url, tmp_path, admin_key)):
            yield app, client, admin_key
    finally:
        await drop_database(database_url)


@pytest.fixture
async def sqlite_app(settings: Settings, tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    (tmp_path / "var").mkdir()
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'var' / 'xmark.db'}"
    await asyncio.to_thread(upgrade_database, database_url)
    admin_key = generate_api_key().plaintext
    async for app, client in _started(_own_settings(settings, database_url, tmp_path / "var", admin_key)):
        yield app, client, admin_key


async def _concurrent_changes_give_one_chain(app: Any, client: httpx.AsyncClient, admin_key: str) -> None:
    H = bearer(admin_key)
    async with session_scope(app.state.resources.sessionmaker) as session:
        startup = await _entries(session)
    # start-up: v1 activated (the first version), v2 registered pending, the bootstrap admin created
    assert [(e.action, e.actor_kind, e.request_id) for e in startup] == [
        ("key_version.activate", "system", None),
        ("key_version.register", "system", None),
        ("user.create", "system", None),
    ]
    users = await asyncio.gather(
        *(client.post("/admin/users", json={"name": f"racer-{i}"}, headers=H) for i in range(ROUNDS))
    )
    assert all(r.status_code == 201 for r in users), [r.text for r in users]
    ids = [r.json()["id"] for r in users]
    mixed = await asyncio.gather(
        *(client.post(f"/admin/users/{i}/keys", headers=H) for i in ids),
        *(client.patch(f"/admin/users/{i}", json={"requests_per_minute": 5}, headers=H) for i in ids),
        *(client.post(f"/admin/users/{i}/disable", headers=H) for i in ids[: ROUNDS // 2]),
    )
    assert all(r.status_code in (200, 201) for r in mixed), [r.text for r in mixed]
    async with session_scope(app.state.resources.sessionmaker) as session:
        entries = await _entries(session)
        head = await _head(session)
    responses = [*users, *mixed]
    assert [e.seq for e in entries] == list(range(1, len(startup) + len(responses) + 1))
    assert [e.prev_hash for e in entries] == [GENESIS_HASH, *(e.entry_hash for e in entries[:-1])]
    assert head == (entries[-1].seq, entries[-1].entry_hash)
    by_request = {e.request_id: e for e in entries[len(startup) :]}
    assert set(by_request) == {r.headers["x-request-id"] for r in responses}  # one entry each
    verifier, problem, _ = await check_trail(
        app.state.resources.settings, [app.state.resources.report_signer.public_key]
    )
    assert problem is None and verifier.count == len(entries)


@pytest.mark.postgres
async def test_concurrent_changes_give_a_gapless_chain_postgres(
    postgres_app: tuple[Any, httpx.AsyncClient, str],
) -> None:
    await _concurrent_changes_give_one_chain(*postgres_app)


async def test_concurrent_changes_give_a_gapless_chain_sqlite(sqlite_app: tuple[Any, httpx.AsyncClient, str]) -> None:
    await _concurrent_changes_give_one_chain(*sqlite_app)
