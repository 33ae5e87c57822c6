"""The "last one" guards under truly concurrent requests: two admins taking each other's admin
access at the same moment, two retirements of the last two active key versions.

The usual ``client`` fixture runs every request on one rolled-back connection, which serialises
them; here the app has a database of its own (beside the test database on the same PostgreSQL
server, or an embedded SQLite file) and a real pool, and the racing requests run at once
(``asyncio.gather``), each in its own transaction on its own connection.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

import service.resources
from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.app import create_app
from service.config import Settings
from service.db import session_scope, upgrade_database
from service.models import KeyVersion, User
from service.repositories.unit import Repositories
from service.security import generate_api_key
from service.services.users import UserService
from service.vocabulary import Role
from tests.fakes import FakeBackend

ROUNDS = 20
# one secret per key version a round activates, plus the first
VERSIONS = [f"r{i}" for i in range(ROUNDS + 1)]
SPARE_VERSION = "spare"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _started(settings: Settings) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    def fake_backend(settings: Settings, metrics: Any) -> FakeBackend:
        return FakeBackend(settings.model_name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", fake_backend)
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            # (60 s: 5x margin and more, a whole test here took 4.3 s or less)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
                yield app, client


def _race_settings(settings: Settings, database_url: str, var_dir: Path, admin_key: str) -> Settings:
    secret_list = ",".join(f"{name}:{secrets.token_hex(24)}" for name in [*VERSIONS, SPARE_VERSION])
    return settings.model_copy(
        update={
            "database_url": database_url,
            "var_dir": var_dir,
            "watermark_secrets": SecretStr(secret_list),
            "bootstrap_admin_key": SecretStr(admin_key),
            "database_pool_size": 8,
        }
    )


@pytest.fixture(scope="module")
async def postgres_app(
    settings: Settings, migrated_database: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    """An app on a fresh database of its own (real pool, nothing rolled back), its first admin's key."""
    name = f"{make_url(settings.database_url).database}_races_{os.getpid()}"
    database_url = sibling_url(settings.database_url, name)
    await create_database(database_url, replace=True)
    try:
        await asyncio.to_thread(upgrade_database, database_url)
        admin_key = generate_api_key().plaintext
        race_settings = _race_settings(settings, database_url, tmp_path_factory.mktemp("races"), admin_key)
        async for app, client in _started(race_settings):
            yield app, client, admin_key
    finally:
        await drop_database(database_url)


@pytest.fixture
async def sqlite_app(settings: Settings, tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'var' / 'xmark.db'}"
    (tmp_path / "var").mkdir()
    await asyncio.to_thread(upgrade_database, database_url)
    admin_key = generate_api_key().plaintext
    async for app, client in _started(_race_settings(settings, database_url, tmp_path / "var", admin_key)):
        yield app, client, admin_key


async def _active_admins(app: Any) -> int:
    async with session_scope(app.state.resources.sessionmaker) as session:
        stmt = select(func.count()).select_from(User).where(User.role == "admin", User.status == "active")
        return int(await session.scalar(stmt) or 0)


async def _active_versions(app: Any) -> list[str]:
    async with session_scope(app.state.resources.sessionmaker) as session:
        rows = await session.scalars(select(KeyVersion.name).where(KeyVersion.status == "active"))
        return list(rows.all())


# each way an admin can take another admin's access away: (method, path suffix, body)
TAKE_AWAY = {
    "disable": ("POST", "/disable", None),
    "delete": ("DELETE", "", None),
    "demote": ("PATCH", "", {"role": "user"}),
}


async def _take_away(client: httpx.AsyncClient, actor_key: str, target: int, how: str) -> httpx.Response:
    method, suffix, body = TAKE_AWAY[how]
    return await client.request(method, f"/admin/users/{target}{suffix}", json=body, headers=bearer(actor_key))


async def _two_admins_alone(
    client: httpx.AsyncClient, survivor: str, name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two new admins, A and B (created by ``survivor``); A then disables every other active admin,
    so A and B are the only ones."""
    created = []
    for side in ("a", "b"):
        response = await client.post(
            "/admin/users", json={"name": f"{name}-{side}", "role": "admin"}, headers=bearer(survivor)
        )
        assert response.status_code == 201, response.text
        created.append(response.json())
    a, b = created
    me = await client.get("/admin/users?role=admin&status=active&limit=500", headers=bearer(a["api_key"]))
    for user in me.json()["data"]:
        if user["id"] not in (a["id"], b["id"]):
            assert (await _take_away(client, a["api_key"], user["id"], "disable")).status_code == 200
    return a, b


async def _admins_race(app: Any, client: httpx.AsyncClient, first_admin_key: str, rounds: int) -> str:
    """Each round: exactly two active admins, A and B, take each other's access at the same moment.

    One change must win and the other be refused with 409 last_admin; one admin always remains.
    Returns the key of the admin that remains.
    """
    survivor = first_admin_key
    ways = itertools.cycle(itertools.product(TAKE_AWAY, repeat=2))
    for round_ in range(rounds):
        a, b = await _two_admins_alone(client, survivor, f"admin-{round_}")
        assert await _active_admins(app) == 2
        for key in (a["api_key"], b["api_key"]):  # both authenticated (cached) before they race
            assert (await client.get("/admin/users?limit=1", headers=bearer(key))).status_code == 200
        how_a, how_b = next(ways)
        results = await asyncio.gather(
            _take_away(client, a["api_key"], b["id"], how_a),
            _take_away(client, b["api_key"], a["id"], how_b),
        )
        statuses = sorted(r.status_code for r in results)
        assert statuses == [200, 409], (round_, how_a, how_b, [r.text for r in results])
        refused = next(r for r in results if r.status_code == 409)
        assert refused.json()["error"]["code"] == "last_admin"
        assert await _active_admins(app) == 1
        survivor = a["api_key"] if results[0].status_code == 200 else b["api_key"]
    return survivor


async def _keys_race(app: Any, client: httpx.AsyncClient, first_admin_key: str, rounds: int) -> str:
    """Each round: exactly two active admins, A and B, each with one key, revoke each other's key at
    the same moment. One revocation must win and the other be refused with 409 last_admin_key: the
    admin API stays reachable. Returns the key that remains."""
    survivor = first_admin_key
    for round_ in range(rounds):
        a, b = await _two_admins_alone(client, survivor, f"keys-{round_}")
        key_ids = {}
        for admin in (a, b):
            (key,) = (await client.get(f"/admin/users/{admin['id']}/keys", headers=bearer(a["api_key"]))).json()["data"]
            key_ids[admin["id"]] = key["id"]
        results = await asyncio.gather(
            client.post(f"/admin/users/{b['id']}/keys/{key_ids[b['id']]}/revoke", headers=bearer(a["api_key"])),
            client.post(f"/admin/users/{a['id']}/keys/{key_ids[a['id']]}/revoke", headers=bearer(b["api_key"])),
        )
        statuses = sorted(r.status_code for r in results)
        assert statuses == [200, 409], (round_, [r.text for r in results])
        refused = next(r for r in results if r.status_code == 409)
        assert refused.json()["error"]["code"] == "last_admin_key"
        survivor = a["api_key"] if results[0].status_code == 200 else b["api_key"]
        assert (await client.get("/admin/users?limit=1", headers=bearer(survivor))).status_code == 200
    return survivor


async def _versions_race(app: Any, client: httpx.AsyncClient, admin_key: str, rounds: int) -> None:
    """Each round: exactly two active key versions are retired at the same moment; one must remain."""
    listed = (await client.get("/admin/key-versions", headers=bearer(admin_key))).json()["data"]
    ids = {v["name"]: v["id"] for v in listed}
    for round_ in range(rounds):
        (current,) = await _active_versions(app)
        added = await client.post("/admin/key-versions", json={"name": VERSIONS[round_ + 1]}, headers=bearer(admin_key))
        assert added.status_code == 201, added.text
        results = await asyncio.gather(
            *(
                client.post(f"/admin/key-versions/{version_id}/retire", headers=bearer(admin_key))
                for version_id in (ids[current], added.json()["id"])
            )
        )
        statuses = sorted(r.status_code for r in results)
        assert statuses == [200, 409], (round_, [r.text for r in results])
        refused = next(r for r in results if r.status_code == 409)
        assert refused.json()["error"]["code"] == "last_active_key_version"
        assert len(await _active_versions(app)) == 1
        # the process's keyring agrees: a version still encodes
        assert app.state.resources.keyring.active().name in await _active_versions(app)


async def test_two_admins_taking_each_others_access_leave_one_postgres(
    postgres_app: tuple[Any, httpx.AsyncClient, str],
) -> None:
    app, client, admin_key = postgres_app
    await _admins_race(app, client, admin_key, ROUNDS)


async def test_two_admins_revoking_each_others_last_key_leave_one_postgres(
    postgres_app: tuple[Any, httpx.AsyncClient, str],
) -> None:
    app, client, _ = postgres_app
    async with session_scope(app.state.resources.sessionmaker) as session:
        created = await UserService(
            Repositories(session), app.state.resources.keyring.params, app.state.resources.api_key_hasher
        ).create_user("keys-admin", Role.ADMIN)
    await _keys_race(app, client, created.api_key, ROUNDS)


async def test_retiring_the_last_two_key_versions_at_once_leaves_one_postgres(
    postgres_app: tuple[Any, httpx.AsyncClient, str],
) -> None:
    app, client, _ = postgres_app
    # an admin of its own: the first admin may have lost its access in another test of this module
    async with session_scope(app.state.resources.sessionmaker) as session:
        created = await UserService(
            Repositories(session), app.state.resources.keyring.params, app.state.resources.api_key_hasher
        ).create_user("versions-admin", Role.ADMIN)
    await _versions_race(app, client, created.api_key, ROUNDS)


async def test_one_version_activated_twice_at_once_is_activated_once_postgres(
    postgres_app: tuple[Any, httpx.AsyncClient, str],
) -> None:
    app, client, _ = postgres_app
    async with session_scope(app.state.resources.sessionmaker) as session:
        created = await UserService(
            Repositories(session), app.state.resources.keyring.params, app.state.resources.api_key_hasher
        ).create_user("activating-admin", Role.ADMIN)
    headers = bearer(created.api_key)
    results = await asyncio.gather(
        *(client.post("/admin/key-versions", json={"name": SPARE_VERSION}, headers=headers) for _ in range(2))
    )
    assert sorted(r.status_code for r in results) == [201, 409], [r.text for r in results]
    assert SPARE_VERSION in await _active_versions(app)
    # leave one active version behind, as the other tests of this module expect
    spare = next(r.json() for r in results if r.status_code == 201)
    assert (await client.post(f"/admin/key-versions/{spare['id']}/retire", headers=headers)).status_code == 200


async def test_guards_hold_on_sqlite_too(sqlite_app: tuple[Any, httpx.AsyncClient, str]) -> None:
    app, client, admin_key = sqlite_app
    survivor = await _admins_race(app, client, admin_key, 4)
    survivor = await _keys_race(app, client, survivor, 4)
    await _versions_race(app, client, survivor, 4)
