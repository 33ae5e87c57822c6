"""The read endpoints of the console: the audit log (GET /traces), usage per day (GET
/admin/usage), user search (GET /admin/users?q=), keys by prefix (GET /admin/api-keys), GET /me."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation, KeyVersion, Trace


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _add_traces(session: AsyncSession, rows: list[dict[str, Any]]) -> list[str]:
    ids = []
    for row in rows:
        report_id = "trc_" + uuid.uuid4().hex[:24]
        session.add(Trace(report_id=report_id, p_value=0.5, statistic=1.0, scored_tokens=20, decoder="counting", **row))
        ids.append(report_id)
    await session.flush()
    await session.commit()
    return ids


async def test_audit_log_pages_and_filters(client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any) -> None:
    auditor, auditor_key = await make_user("auditor")
    other, _ = await make_user("auditor")
    writer, _ = await make_user("user", "writer")
    _, user_key = await make_user("user")
    base = datetime(2030, 1, 1, tzinfo=UTC)  # newer than any trace of other tests
    rows = [
        {"requester_id": auditor["user_id"], "verdict": "watermarked", "attributed_user_id": writer["user_id"]},
        {"requester_id": auditor["user_id"], "verdict": "not_watermarked", "attributed_user_id": None},
        {"requester_id": other["user_id"], "verdict": "watermarked", "attributed_user_id": writer["user_id"]},
        {"requester_id": other["user_id"], "verdict": "watermarked", "attributed_user_id": None},
        {"requester_id": auditor["user_id"], "verdict": "watermarked", "attributed_user_id": writer["user_id"]},
    ]
    for i, row in enumerate(rows):
        row["created_at"] = base + timedelta(minutes=i)
    ids = await _add_traces(db_session, rows)

    assert (await client.get("/traces", headers=_auth(user_key))).status_code == 403
    first = (await client.get("/traces?limit=2", headers=_auth(auditor_key))).json()
    assert [e["report_id"] for e in first["data"]] == [ids[4], ids[3]]  # newest first
    assert first["has_more"] is True and first["total"] >= 5 and first["limit"] == 2
    entry = first["data"][0]
    assert entry["requester_name"] == auditor["name"] and entry["attributed_user_name"] == "writer"
    second = (await client.get("/traces?limit=2&offset=2", headers=_auth(auditor_key))).json()
    assert [e["report_id"] for e in second["data"]] == [ids[2], ids[1]]

    mine = (await client.get(f"/traces?requester_id={auditor['user_id']}", headers=_auth(auditor_key))).json()
    assert [e["report_id"] for e in mine["data"]] == [ids[4], ids[1], ids[0]] and mine["total"] == 3
    named = await client.get(
        f"/traces?attributed_user_id={writer['user_id']}&verdict=watermarked", headers=_auth(auditor_key)
    )
    assert [e["report_id"] for e in named.json()["data"]] == [ids[4], ids[2], ids[0]]
    unwatermarked = await client.get(
        f"/traces?verdict=not_watermarked&requester_id={auditor['user_id']}", headers=_auth(auditor_key)
    )
    assert [e["report_id"] for e in unwatermarked.json()["data"]] == [ids[1]]
    bad = await client.get("/traces?limit=501", headers=_auth(auditor_key))
    assert bad.status_code == 400 or bad.status_code == 422
    assert "error" in bad.json()
    # a trace recorded before reports were signed: served, unsigned
    legacy = await client.get(f"/trace/{ids[0]}", headers=_auth(auditor_key))
    assert legacy.status_code == 200
    assert legacy.json()["signature"] is None and legacy.json()["report"]["attributed_user_name"] == "writer"


async def test_usage_per_user_per_day(client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any) -> None:
    _, admin_key = await make_user("admin")
    alice, alice_key = await make_user("user", "alice")
    bob, _ = await make_user("user", "bob")
    version = (await db_session.scalars(select(KeyVersion.id).limit(1))).one()
    now = datetime.now(UTC)
    today = now.date().isoformat()
    yesterday = (now - timedelta(days=1)).date().isoformat()
    # (user, request, choice, prompt, completion, age): alice's request r1 has two choices
    generations = [
        (alice, "r1", 0, 10, 5, timedelta(0)),
        (alice, "r1", 1, 10, 7, timedelta(0)),
        (alice, "r2", 0, 3, 4, timedelta(0)),
        (alice, "r3", 0, 8, 9, timedelta(days=1)),
        (bob, "r4", 0, 6, 1, timedelta(0)),
        (alice, "r5", 0, 100, 100, timedelta(days=40)),  # outside the default 30 days
    ]
    for user, rid, choice, prompt, completion, age in generations:
        db_session.add(
            Generation(
                request_id=f"{rid}-{uuid.uuid4().hex[:8]}" if rid != "r1" else f"r1-{alice['user_id']}",
                choice_index=choice,
                user_id=user["user_id"],
                key_version_id=version,
                model="m",
                prompt_tokens=prompt,
                completion_tokens=completion,
                completion_sha256="0" * 64,
                created_at=now - age,
            )
        )
    await db_session.commit()

    assert (await client.get("/admin/usage", headers=_auth(alice_key))).status_code == 403
    body = (await client.get(f"/admin/usage?user_id={alice['user_id']}", headers=_auth(admin_key))).json()
    assert body["object"] == "list" and body["total"] == 2
    assert body["data"] == [
        {
            "user_id": alice["user_id"],
            "user_name": "alice",
            "day": today,
            "requests": 2,
            "completions": 3,
            "prompt_tokens": 13,  # r1's prompt once, r2's
            "completion_tokens": 16,
            "embedding_requests": 0,  # no /v1/embeddings request that day
            "embedding_tokens": 0,
        },
        {
            "user_id": alice["user_id"],
            "user_name": "alice",
            "day": yesterday,
            "requests": 1,
            "completions": 1,
            "prompt_tokens": 8,
            "completion_tokens": 9,
            "embedding_requests": 0,  # no /v1/embeddings request that day
            "embedding_tokens": 0,
        },
    ]
    recent = (await client.get(f"/admin/usage?user_id={alice['user_id']}&days=1", headers=_auth(admin_key))).json()
    assert [d["day"] for d in recent["data"]] == [today]
    older = (await client.get(f"/admin/usage?user_id={alice['user_id']}&days=60", headers=_auth(admin_key))).json()
    assert older["total"] == 3 and older["data"][-1]["completion_tokens"] == 100
    everyone = (await client.get("/admin/usage?days=1&limit=500", headers=_auth(admin_key))).json()
    by_user = {(d["user_id"], d["day"]): d for d in everyone["data"]}
    assert by_user[(bob["user_id"], today)]["completion_tokens"] == 1
    assert all(d["day"] == today for d in everyone["data"])
    page = (await client.get(f"/admin/usage?user_id={alice['user_id']}&limit=1", headers=_auth(admin_key))).json()
    assert page["has_more"] is True and [d["day"] for d in page["data"]] == [today]
    assert (await client.get("/admin/usage?days=0", headers=_auth(admin_key))).status_code in (400, 422)


async def test_user_search_escapes_wildcards(client: httpx.AsyncClient, make_user: Any) -> None:
    _, admin_key = await make_user("admin")
    await make_user("user", "Ops 100% Team")
    await make_user("user", "ops 1000 team")
    await make_user("user", "dev_lead")
    await make_user("user", "devXlead")

    async def names(q: str) -> list[str]:
        response = await client.get("/admin/users", params={"q": q, "limit": 500}, headers=_auth(admin_key))
        assert response.status_code == 200
        return sorted(u["name"] for u in response.json()["data"])

    assert await names("100%") == ["Ops 100% Team"]
    assert await names("OPS 100") == ["Ops 100% Team", "ops 1000 team"]  # case-insensitive
    assert await names("dev_") == ["dev_lead"]
    assert await names("_") == ["dev_lead"]


async def test_api_keys_by_prefix(client: httpx.AsyncClient, make_user: Any) -> None:
    _, admin_key = await make_user("admin")
    alice, _ = await make_user("user")
    issued = (await client.post(f"/admin/users/{alice['user_id']}/keys", headers=_auth(admin_key))).json()
    prefix = issued["prefix"]
    found = (await client.get("/admin/api-keys", params={"prefix": prefix}, headers=_auth(admin_key))).json()
    assert found["object"] == "list" and issued["id"] in [k["id"] for k in found["data"]]
    assert all(k["prefix"].startswith(prefix) for k in found["data"]) and found["total"] == len(found["data"])
    assert "api_key" not in found["data"][0] and "key_hash" not in found["data"][0]
    shorter = (await client.get("/admin/api-keys", params={"prefix": prefix[:-2]}, headers=_auth(admin_key))).json()
    assert shorter["total"] >= found["total"]
    none = (await client.get("/admin/api-keys", params={"prefix": prefix + "%"}, headers=_auth(admin_key))).json()
    assert none["total"] == 0
    paged = (await client.get("/admin/api-keys?limit=1", headers=_auth(admin_key))).json()
    assert len(paged["data"]) == 1 and paged["has_more"] is True
    mine = (await client.get("/admin/api-keys", params={"user_id": alice["user_id"]}, headers=_auth(admin_key))).json()
    assert mine["total"] == 2 and {k["user_id"] for k in mine["data"]} == {alice["user_id"]}
    both = {"user_id": alice["user_id"], "prefix": prefix}
    narrowed = (await client.get("/admin/api-keys", params=both, headers=_auth(admin_key))).json()
    assert [k["id"] for k in narrowed["data"]] == [issued["id"]]


async def test_me_per_role(client: httpx.AsyncClient, make_user: Any) -> None:
    for role in ("user", "auditor", "admin"):
        principal, key = await make_user(role)
        response = await client.get("/me", headers=_auth(key))
        assert response.status_code == 200
        assert response.json() == {"user_id": principal["user_id"], "name": principal["name"], "role": role}
    assert (await client.get("/me")).status_code == 401


async def test_usage_days_on_sqlite(tmp_path: Any) -> None:
    """The UTC day of the embedded database's naive timestamps groups as PostgreSQL's does."""
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from service.db import upgrade_database
    from service.models import User
    from service.repositories.usage import UsageRepository

    url = f"sqlite+aiosqlite:///{tmp_path / 'usage.db'}"
    await asyncio.to_thread(upgrade_database, url)
    engine = create_async_engine(url)
    try:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        async with maker() as session:
            user = User(name="carol", role="user", status="active", message_id="01")
            version = KeyVersion(
                name="v1", bits=2, block_bits=2, num_keys=1, delta=2.0, scheme="xmark", fingerprint="f", status="active"
            )
            session.add_all([user, version])
            await session.flush()
            late = datetime(2031, 5, 6, 23, 59, 59, tzinfo=UTC)
            for rid, choice, moment in (("a", 0, late), ("a", 1, late), ("b", 0, late + timedelta(seconds=2))):
                session.add(
                    Generation(
                        request_id=rid,
                        choice_index=choice,
                        user_id=user.id,
                        key_version_id=version.id,
                        model="m",
                        prompt_tokens=4,
                        completion_tokens=3,
                        completion_sha256="0" * 64,
                        created_at=moment,
                    )
                )
            await session.commit()
            rows, total = await UsageRepository(session).per_user_day(
                since=datetime(2031, 5, 1, tzinfo=UTC), user_id=None, limit=10, offset=0
            )
    finally:
        await engine.dispose()
    assert total == 2
    assert [(r.day, r.requests, r.completions, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        ("2031-05-07", 1, 1, 4, 3),
        ("2031-05-06", 1, 2, 4, 6),
    ]
