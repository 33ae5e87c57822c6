"""Key versions of different message lengths coexist: a 16-bit deployment rotates to a version
of the configured length (64 bits by default) or of 32 bits. Every user (deleted ones included)
gets an ID of the new length, generations are encoded with the ID
of the active version's length, text of the old version is still traced to its author, and the
backfill is idempotent and safe when two sessions race; end users get theirs in the activation (a
first batch) and in the background backfill (the rest, and at start-up)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

import service.resources
import service.services.message_ids
from service.app import create_app
from service.config import ConfigurationError
from service.db import MAINTENANCE_TIMEOUT_S, create_engine, create_sessionmaker, session_scope
from service.end_users.directory import EndUserCache, EndUserDirectory
from service.errors import ServiceUnavailableError
from service.keyring import Keyring
from service.models import EndUser, Generation, KeyVersion, MessageId, RegistryAuditEntry, Trace, User
from service.repositories.unit import Repositories
from service.resources import startup_sessions, sync_keyring
from service.schemas.admin import CreatedUser
from service.schemas.chat import ChatCompletionRequest
from service.schemas.common import MessageIdOut, Principal
from service.security import ApiKeyHasher
from service.services.audit import SYSTEM_ACTOR, AuditTrail
from service.services.generation import GenerationService
from service.services.key_versions import KeyVersionService
from service.services.message_ids import MessageIdService, backfill_end_user_message_ids, backfill_message_ids
from service.services.reports import ReportSigner
from service.services.users import UserService
from tests.conftest import TEST_API_KEY_PEPPER, TEST_WATERMARK_SECRETS, make_test_settings
from tests.fakes import FakeBackend
from xmark_core import MessageAllocator, WatermarkKey, WatermarkParams
from xmark_core.encoders import DEFAULT_MESSAGE_BITS

P16 = WatermarkParams(bits=16)
P32 = WatermarkParams(bits=32)
# the length of the shared app's new key versions (the configured default): the rotations from 16
NEW = DEFAULT_MESSAGE_BITS
PNEW = WatermarkParams(bits=NEW)
MODEL = "smollm2-135m-instruct"
ESSAY = "Write a detailed essay about the history of sailing ships, with many facts."
S1 = TEST_WATERMARK_SECRETS["v1"].encode()
S2 = TEST_WATERMARK_SECRETS["v2"].encode()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _id_of(created: CreatedUser | Principal, bits: int) -> str | None:
    return next((m.message_id for m in created.message_ids if m.bits == bits), None)


async def _lengths_of(session: AsyncSession, user_id: int) -> dict[int, str]:
    rows = (await session.scalars(select(MessageId).where(MessageId.user_id == user_id))).all()
    return {row.bits: row.message_id for row in rows}


@dataclass
class Deployment:
    """The test transaction turned into a 16-bit deployment: v1 (16 bits) is the only version."""

    v1: KeyVersion
    author: CreatedUser
    gone: CreatedUser  # deleted before the rotation
    auditor: CreatedUser
    admin: CreatedUser


@pytest.fixture
async def sixteen_bit(app: Any, db_session: AsyncSession, monkeypatch: pytest.MonkeyPatch, ready: None) -> Deployment:
    """v1 as a 16-bit active version (the test secrets' v2 has no row yet) and users created with
    16-bit IDs only; rolled back with the test (the keyring is reloaded then). After ``ready``: the
    app's start-up tasks share the test's connection, and one still writing there when the model
    loads slowly (the first test of the module, on a loaded machine) put its v1 row back after the
    delete below (a duplicate key here) or rolled the savepoint back (no v1 after the rotation)."""
    resources = app.state.resources
    monkeypatch.setattr(resources.registry_cache, "check_interval", 0.0)
    for table in (Generation, Trace, KeyVersion):  # rows of this transaction only: rolled back
        await db_session.execute(delete(table))
    now = datetime.now(UTC)
    v1 = KeyVersion(
        name="v1",
        bits=16,
        block_bits=2,
        num_keys=2,
        delta=2.0,
        scheme="xmark",
        fingerprint=WatermarkKey.from_secret(S1, P16).fingerprint,
        status="active",
        created_at=now,
        activated_at=now,
    )
    db_session.add(v1)
    await db_session.flush()
    await resources.keyring.refresh(db_session)
    assert [(h.name, h.key.params.bits) for h in resources.keyring.usable()] == [("v1", 16)]
    users = UserService(Repositories(db_session), P16, resources.api_key_hasher)  # configured for 16 bits, as before
    author = await users.create_user("author", "user")
    gone = await users.create_user("gone", "user")
    await users.delete_user(gone.id)
    auditor = await users.create_user("auditor", "auditor")
    admin = await users.create_user("admin", "admin")
    for created in (author, gone, auditor, admin):
        assert [(m.bits, m.block_bits) for m in created.message_ids] == [(16, 2)]
    await db_session.flush()
    return Deployment(v1, author, gone, auditor, admin)


@pytest.fixture
def seeded_backfill(seeded_message_ids: random.Random, monkeypatch: pytest.MonkeyPatch) -> None:
    """Users get their IDs from the seeded allocation (``seeded_message_ids``), at creation and
    when a key version of a new length gives every user one (``MessageIdService``, the product's
    ``MessageAllocator`` with its ``rng``): a test whose verdict depends on the IDs gives the same
    outcome on every run. (Tests of the allocation itself, uniqueness under races, draw at random.)"""
    allocator = functools.partial(MessageAllocator, rng=seeded_message_ids)
    monkeypatch.setattr(service.services.message_ids, "MessageAllocator", allocator)


def _generation(app: Any) -> GenerationService:
    resources = app.state.resources
    return GenerationService(
        resources.generation_records, resources.settings, resources.backend, resources.keyring, resources.metrics
    )


async def _prepared_message(app: Any, key: str) -> tuple[str, str]:
    """(message bits, key version) a completion for ``key``'s user would be encoded with now."""
    principal = await app.state.resources.authenticator.authenticate(f"Bearer {key}")
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    )
    prepared = _generation(app).prepare(principal, body)
    return prepared.stamp.message.bits, prepared.stamp.key_version


async def _activate_v2(client: httpx.AsyncClient, admin_key: str) -> dict[str, Any]:
    response = await client.post("/admin/key-versions", json={"name": "v2"}, headers=_auth(admin_key))
    assert response.status_code == 201, response.text
    return dict(response.json())


async def test_rotating_to_a_version_of_the_configured_length_gives_every_user_an_id_of_it(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, sixteen_bit: Deployment
) -> None:
    d = sixteen_bit
    assert await app.state.resources.backend.wait_ready(180)
    # under the 16-bit version: encoded with the author's 16-bit ID
    assert await _prepared_message(app, d.author.api_key) == (_id_of(d.author, 16), "v1")

    v2 = await _activate_v2(client, d.admin.api_key)
    assert (v2["bits"], v2["block_bits"], v2["status"]) == (NEW, 2, "active")
    keyring = app.state.resources.keyring
    assert keyring.active().name == "v2" and keyring.lengths() == {(16, 2), (NEW, 2)}

    ids = {}
    for user in (d.author, d.gone, d.auditor, d.admin):  # the deleted user too: IDs are never reused
        held = await _lengths_of(db_session, user.id)
        assert set(held) == {16, NEW} and held[16] == _id_of(user, 16)
        row = await db_session.get(User, user.id)
        assert row is not None and row.message_id == held[16]  # the ID it was created with stays
        ids[user.id] = held
    for bits in (16, NEW):
        stmt = select(MessageId.message_id).where(MessageId.bits == bits)
        assert max(Counter((await db_session.scalars(stmt)).all()).values()) == 1  # unique per length

    # generations are now encoded with the new-length ID under v2 (the cached principal was dropped)
    assert await _prepared_message(app, d.author.api_key) == (ids[d.author.id][NEW], "v2")
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=_auth(d.author.api_key),
    )
    assert response.status_code == 200, response.text

    # the admin API shows the ID of the active version's length and all of them
    shown = (await client.get(f"/admin/users/{d.gone.id}", headers=_auth(d.admin.api_key))).json()
    assert shown["status"] == "deleted" and shown["message_id"] == ids[d.gone.id][NEW]
    assert shown["message_ids"] == [
        {"bits": 16, "block_bits": 2, "message_id": ids[d.gone.id][16]},
        {"bits": NEW, "block_bits": 2, "message_id": ids[d.gone.id][NEW]},
    ]
    listed = (await client.get("/admin/users?limit=10", headers=_auth(d.admin.api_key))).json()
    assert {u["id"]: u["message_id"] for u in listed["data"]} == {uid: held[NEW] for uid, held in ids.items()}

    # new users get an ID of both lengths; running the backfill again finds nothing to do
    created = (await client.post("/admin/users", json={"name": "newcomer"}, headers=_auth(d.admin.api_key))).json()
    assert [(m["bits"], m["block_bits"]) for m in created["message_ids"]] == [(16, 2), (NEW, 2)]
    assert created["message_id"] == created["message_ids"][1]["message_id"]
    assert await MessageIdService(Repositories(db_session)).fill([P16, PNEW]) == 0


async def test_a_principal_without_an_id_of_the_active_length_gets_503(app: Any) -> None:
    """Never encoded with an ID of another length: refused cleanly instead."""
    assert await app.state.resources.backend.wait_ready(180)
    active = app.state.resources.keyring.active()
    assert active.key.params.bits != 16
    sixteen = MessageIdOut(bits=16, block_bits=2, message_id="0110100111000101")
    caller = Principal(user_id=1, name="u", role="user", api_key_id=1, message_ids=(sixteen,))
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    )
    with pytest.raises(ServiceUnavailableError) as caught:
        _generation(app).prepare(caller, body)
    assert caught.value.code == "message_id_missing" and active.name in caught.value.message


@pytest.mark.model
@pytest.mark.usefixtures("seeded_backfill")  # the author's 16- and 64-bit IDs, and the answers: seeded
async def test_text_of_the_old_version_is_traced_after_the_rotation(
    app: Any, client: httpx.AsyncClient, sixteen_bit: Deployment
) -> None:
    """Generated while the 16-bit version was active, traced after the new-length one took over; and
    text generated under the new-length version is traced too."""
    d = sixteen_bit
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"

    async def essay() -> str:
        # 400 tokens, as in test_trace: enough for the detection verdict, not only the attribution
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": ESSAY}],
            "max_tokens": 400,
            "temperature": 0.8,
            "seed": 7,
        }
        response = await client.post("/v1/chat/completions", json=body, headers=_auth(d.author.api_key))
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    async def trace(text: str) -> dict[str, Any]:
        response = await client.post("/trace", json={"text": text}, headers=_auth(d.auditor.api_key))
        assert response.status_code == 200, response.text
        return dict(response.json())

    old_text = await essay()
    await _activate_v2(client, d.admin.api_key)
    new_text = await essay()

    old = await trace(old_text)
    assert old["key_version"] == "v1" and old["watermarked"] is True
    assert len(old["decoded_message"]) == 16
    assert old["attribution"] is not None and old["attribution"]["user_id"] == d.author.id
    new = await trace(new_text)
    assert new["key_version"] == "v2" and len(new["decoded_message"]) == NEW
    assert new["attribution"] is not None and new["attribution"]["user_id"] == d.author.id


async def test_the_backfill_keeps_the_id_a_user_was_created_with(app: Any, db_session: AsyncSession) -> None:
    """A user row written without message_ids rows (as a bulk import would) keeps its
    users.message_id as its ID of that length, unless another user holds it there."""
    active = app.state.resources.keyring.active().key.params
    now = datetime.now(UTC)
    taken = await UserService(Repositories(db_session), active, app.state.resources.api_key_hasher).create_user(
        "holder", "user"
    )
    bare = [
        User(name=f"imported-{i}", role="user", status="active", message_id=bits, created_at=now, updated_at=now)
        for i, bits in enumerate(["01" * (active.bits // 2), "10" * (active.bits // 2)])
    ]
    db_session.add_all(bare)
    await db_session.flush()
    # the holder's ID of this length clashes with nobody's users.message_id; make one clash
    holder = (await db_session.scalars(select(MessageId).where(MessageId.user_id == taken.id))).one()
    holder.message_id = bare[1].message_id
    await db_session.flush()

    assert await MessageIdService(Repositories(db_session)).fill([active]) == 2
    kept = await _lengths_of(db_session, bare[0].id)
    assert kept == {active.bits: bare[0].message_id}
    moved = await _lengths_of(db_session, bare[1].id)
    assert moved[active.bits] != bare[1].message_id and len(moved[active.bits]) == active.bits
    assert await MessageIdService(Repositories(db_session)).fill([active]) == 0


# -- start-up registration and racing backfills, on databases of their own -------------------------


async def _engines(tmp_path: Path, url: str, count: int) -> list[Any]:
    settings = make_test_settings(tmp_path, database_url=url)
    return [create_engine(settings) for _ in range(count)]


async def _sixteen_bit_users(sessionmaker: async_sessionmaker[AsyncSession], count: int) -> list[int]:
    """A 16-bit deployment registered at start-up, with ``count`` users (every third deleted)."""
    await sync_keyring(Keyring(P16, {"v1": S1}), sessionmaker)
    hasher = ApiKeyHasher(TEST_API_KEY_PEPPER.encode())
    ids = []
    async with session_scope(sessionmaker) as session:
        users = UserService(Repositories(session), P16, hasher)
        for i in range(count):
            created = await users.create_user(f"user-{i}", "user")
            assert [m.bits for m in created.message_ids] == [16]
            if i % 3 == 0:
                await users.delete_user(created.id)
            ids.append(created.id)
    return ids


async def _check_one_id_each(sessionmaker: async_sessionmaker[AsyncSession], user_ids: list[int]) -> None:
    async with sessionmaker() as session:
        for bits in (16, 32):
            rows = (
                await session.execute(select(MessageId.user_id, MessageId.message_id).where(MessageId.bits == bits))
            ).all()
            assert sorted(r.user_id for r in rows) == sorted(user_ids), bits  # exactly one per user
            assert len({r.message_id for r in rows}) == len(rows)  # unique within the length
            assert all(len(r.message_id) == bits for r in rows)


async def test_start_up_registration_of_a_32_bit_version_backfills_every_user(scratch_url: str, tmp_path: Path) -> None:
    (engine,) = await _engines(tmp_path, scratch_url, 1)
    try:
        sessionmaker = create_sessionmaker(engine)
        user_ids = await _sixteen_bit_users(sessionmaker, 12)
        # the deployment now configures 32 bits and a second secret: v2 is registered (pending) at
        # start-up with 32-bit parameters, v1 keeps its 16 bits, and every user gets a 32-bit ID
        keyring = Keyring(P32, {"v1": S1, "v2": S2})
        await sync_keyring(keyring, sessionmaker)
        assert {(h.name, h.key.params.bits, h.status) for h in keyring.usable()} == {
            ("v1", 16, "active"),
            ("v2", 32, "pending"),
        }
        await _check_one_id_each(sessionmaker, user_ids)
        async with sessionmaker() as session:
            count = await session.scalar(select(func.count()).select_from(MessageId))
        await sync_keyring(Keyring(P32, {"v1": S1, "v2": S2}), sessionmaker)  # a restart adds nothing
        async with sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(MessageId)) == count
    finally:
        await engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("scratch_url", ["postgres"], indirect=True)
async def test_start_up_writes_wait_past_the_request_bound(scratch_url: str, tmp_path: Path) -> None:
    """A start-up statement that waits longer than XMARK_DATABASE_TIMEOUT_S (here for a lock another
    session holds on key_versions; in production a backfill over a large registry) fails under a
    request's bound with an error that says the database did not answer (not "run migrate"), and
    is served in ``startup_sessions``, under the maintenance bound."""
    settings = make_test_settings(tmp_path, database_url=scratch_url, database_timeout_s=0.3)
    engine = create_engine(settings)
    locker = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)

    async def hold_lock(locked: asyncio.Event, release: asyncio.Event, at_most_s: float) -> None:
        async with locker.begin() as connection:
            await connection.execute(text("LOCK TABLE key_versions IN ACCESS EXCLUSIVE MODE"))
            locked.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), at_most_s)

    async def waiting_for_the_lock() -> bool:
        async with locker.connect() as connection:
            query = "SELECT count(*) FROM pg_locks WHERE relation = 'key_versions'::regclass AND NOT granted"
            return bool(await connection.scalar(text(query)))

    try:
        sessionmaker = create_sessionmaker(engine)
        locked, release = asyncio.Event(), asyncio.Event()
        # held until the refusal (or 10 s: 5x margin and more, it came 0.33 s after the lock was
        # taken here, the 0.3 s bound; without the bound the statement would wait the 10 s out and
        # succeed, which fails the test)
        holder = asyncio.create_task(hold_lock(locked, release, 10))
        await asyncio.wait_for(locked.wait(), 10)
        with pytest.raises(ConfigurationError, match="did not answer during start-up") as refused:
            await sync_keyring(Keyring(P32, {"v1": S1}), sessionmaker)
        release.set()
        assert "migrate" not in str(refused.value)
        await holder

        locked, release = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(hold_lock(locked, release, 60))
        await asyncio.wait_for(locked.wait(), 10)

        async def release_past_the_request_bound() -> None:
            # once the start-up statement waits for the lock (10 s: 5x margin and more, it waited
            # 0.04 s after the lock was taken here), hold it 5x the request bound longer: a
            # statement under that bound would be refused meanwhile
            deadline = time.monotonic() + 10
            while not await waiting_for_the_lock():
                assert time.monotonic() < deadline, "the start-up statement never waited for the lock"
                await asyncio.sleep(0.02)
            await asyncio.sleep(5 * settings.database_timeout_s)
            release.set()

        releaser = asyncio.create_task(release_past_the_request_bound())
        keyring = Keyring(P32, {"v1": S1})
        async with startup_sessions(settings, sessionmaker) as startup:
            assert startup is not sessionmaker  # an engine of its own
            await sync_keyring(keyring, startup)
        await releaser
        await holder
        assert [(h.name, h.status) for h in keyring.usable()] == [("v1", "active")]
    finally:
        await locker.dispose()
        await engine.dispose()


async def test_racing_backfills_create_no_duplicates(scratch_url: str, tmp_path: Path) -> None:
    first, second = await _engines(tmp_path, scratch_url, 2)
    try:
        one, two = create_sessionmaker(first), create_sessionmaker(second)
        user_ids = await _sixteen_bit_users(one, 9)
        async with session_scope(one) as session:  # a 32-bit version appears (no backfill yet)
            v1 = (await session.scalars(select(KeyVersion))).one()
            session.add(
                KeyVersion(
                    name="v2",
                    bits=32,
                    block_bits=2,
                    num_keys=2,
                    delta=2.0,
                    scheme="xmark",
                    fingerprint=WatermarkKey.from_secret(S2, P32).fingerprint,
                    status="pending",
                    created_at=v1.created_at,
                )
            )

        # two sessions read the same missing users; the second inserts while the first has not
        # committed, waits for it, and skips every row (ON CONFLICT DO NOTHING)
        async with one() as a, two() as b:
            assert await MessageIdService(Repositories(a)).fill([P32], batch_size=4) == len(user_ids)
            racing = asyncio.create_task(MessageIdService(Repositories(b)).fill([P32], batch_size=4))
            await asyncio.sleep(0.5)  # (a later start than that still passes: it then finds nothing to do)
            await a.commit()
            assert await asyncio.wait_for(racing, 60) == 0  # 5x margin and more: the whole test took 1.4 s here
            await b.commit()
        await _check_one_id_each(one, user_ids)

        # whole start-up backfills racing batch by batch (each batch its own unit of work)
        async with session_scope(one) as session:
            await session.execute(delete(MessageId).where(MessageId.bits == 32))
        more = [*user_ids, *await _more_users(one, 7)]
        added = await asyncio.gather(backfill_message_ids(one, batch_size=3), backfill_message_ids(two, batch_size=3))
        assert sum(a.get((32, 2), 0) for a in added) == len(more)
        await _check_one_id_each(one, more)
    finally:
        await first.dispose()
        await second.dispose()


async def _more_users(sessionmaker: async_sessionmaker[AsyncSession], count: int) -> list[int]:
    """Users created while only the 16-bit length is in use (the 32-bit version retired meanwhile)."""
    hasher = ApiKeyHasher(TEST_API_KEY_PEPPER.encode())
    async with session_scope(sessionmaker) as session:
        v2 = (await session.scalars(select(KeyVersion).where(KeyVersion.name == "v2"))).one()
        v2.status = "retired"
        await session.flush()
        users = UserService(Repositories(session), P16, hasher)
        created = [await users.create_user(f"more-{i}", "user") for i in range(count)]
        assert all([m.bits for m in c.message_ids] == [16] for c in created)
        v2.status = "pending"
    return [c.id for c in created]


# -- end users: the activation's first batch, the background backfill ------------------------------


async def _sixteen_bit_end_users(session: AsyncSession, account_id: int, count: int) -> list[int]:
    """``count`` end users of the account holding a 16-bit ID only (every third deleted), IDs drawn
    apart from every 16-bit ID held."""
    held = list((await session.scalars(select(MessageId.message_id).where(MessageId.bits == 16))).all())
    allocator = MessageAllocator(held, P16)
    ids = []
    for i in range(count):
        row = EndUser(user_id=account_id, identifier=f"eu-{i}", status="deleted" if i % 3 == 0 else "active")
        session.add(row)
        await session.flush()
        session.add(MessageId(end_user_id=row.id, bits=16, block_bits=2, message_id=allocator.allocate().bits))
        ids.append(row.id)
    await session.flush()
    return ids


async def _end_user_ids(session: AsyncSession, bits: int) -> dict[int, str]:
    stmt = select(MessageId.end_user_id, MessageId.message_id).where(
        MessageId.bits == bits, MessageId.end_user_id.is_not(None)
    )
    return {int(r.end_user_id): r.message_id for r in (await session.execute(stmt)).all()}


async def _unique_per_length(session: AsyncSession, new: int = NEW) -> None:
    for bits in (16, new):
        held = (await session.scalars(select(MessageId.message_id).where(MessageId.bits == bits))).all()
        assert held and max(Counter(held).values()) == 1, bits  # users' and end users' IDs apart
        assert all(len(m) == bits for m in held)


async def test_rotating_gives_every_end_user_an_id_of_the_new_length_in_the_activation(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, sixteen_bit: Deployment
) -> None:
    d = sixteen_bit
    directory = app.state.resources.end_users
    end_users = await _sixteen_bit_end_users(db_session, d.author.id, 5)
    before = await _end_user_ids(db_session, 16)
    assert set(before) == set(end_users) and await _end_user_ids(db_session, NEW) == {}
    # a cached identity holds the 16-bit ID only: the activation must make it go
    fill_principal = await app.state.resources.authenticator.authenticate(f"Bearer {d.author.api_key}")
    cached = await directory.resolve(fill_principal, "eu-1", (16, 2))
    assert directory.cache.get((d.author.id, "eu-1")) is not None and cached.message_id_for(NEW, 2) is None

    await _activate_v2(client, d.admin.api_key)
    # every end user, the deleted ones too, got a new-length ID in the activation's unit of work (a
    # directory this small fits one batch: no background backfill), apart from every other ID
    after = await _end_user_ids(db_session, NEW)
    assert set(after) == set(end_users)
    assert await _end_user_ids(db_session, 16) == before
    await _unique_per_length(db_session)
    assert not directory._backfills
    entry = (
        await db_session.scalars(
            select(RegistryAuditEntry)
            .where(RegistryAuditEntry.action == "key_version.activate")
            .order_by(RegistryAuditEntry.seq.desc())
        )
    ).first()
    assert entry is not None and entry.changes["after"]["end_user_message_ids_added"] == 5
    # the cache was cleared at the commit; the end user's next request is encoded with its new ID
    # and allocates nothing more
    assert directory.cache.get((d.author.id, "eu-1")) is None
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "user": "eu-1"},
        headers=_auth(d.author.api_key),
    )
    assert response.status_code == 200, response.text
    served = directory.cache.get((d.author.id, "eu-1"))  # as the request resolved it
    assert served is not None and served.identity.message_id_for(NEW, 2) == after[end_users[1]]
    assert await _end_user_ids(db_session, NEW) == after


async def _end_users_of_a_sixteen_bit_deployment(
    sessionmaker: async_sessionmaker[AsyncSession], count: int
) -> list[int]:
    """A 16-bit deployment (``_sixteen_bit_users``) whose second user has ``count`` end users."""
    user_ids = await _sixteen_bit_users(sessionmaker, 2)
    async with session_scope(sessionmaker) as session:
        return await _sixteen_bit_end_users(session, user_ids[1], count)


async def test_the_background_backfill_gives_every_end_user_an_id_batch_by_batch(
    scratch_url: str, tmp_path: Path
) -> None:
    (engine,) = await _engines(tmp_path, scratch_url, 1)
    try:
        sessionmaker = create_sessionmaker(engine)
        end_users = await _end_users_of_a_sixteen_bit_deployment(sessionmaker, 7)
        batches: list[int] = []

        def on_batch() -> None:
            batches.append(len(batches))

        signer = ReportSigner.from_secret(b"end-user backfill test")
        added = await backfill_end_user_message_ids(
            sessionmaker, [P32], batch_size=3, audit=AuditTrail(signer, SYSTEM_ACTOR), on_batch=on_batch
        )
        assert added == {(32, 2): 7} and len(batches) == 3  # 3 + 3 + 1, each committed on its own
        async with sessionmaker() as session:
            assert set(await _end_user_ids(session, 32)) == set(end_users)
            await _unique_per_length(session, 32)
            entries = (
                await session.scalars(
                    select(RegistryAuditEntry)
                    .where(RegistryAuditEntry.action == "message_ids.allocate")
                    .order_by(RegistryAuditEntry.seq)
                )
            ).all()
        allocations = [e.changes["after"] for e in entries if "end_user_ids" in e.changes["after"]]
        spans = [a["end_user_ids"] for a in allocations]
        assert spans == [
            {"from": end_users[0], "to": end_users[2]},
            {"from": end_users[3], "to": end_users[5]},
            {"from": end_users[6], "to": end_users[6]},
        ]
        assert [a["allocated"] for a in allocations] == [3, 3, 1]
        # run again (a restart, another replica): nothing to do, nothing recorded
        assert await backfill_end_user_message_ids(sessionmaker, [P32], batch_size=3) == {(32, 2): 0}
    finally:
        await engine.dispose()


async def test_racing_end_user_backfills_create_no_duplicates(scratch_url: str, tmp_path: Path) -> None:
    first, second = await _engines(tmp_path, scratch_url, 2)
    try:
        one, two = create_sessionmaker(first), create_sessionmaker(second)
        end_users = await _end_users_of_a_sixteen_bit_deployment(one, 11)
        added = await asyncio.gather(
            backfill_end_user_message_ids(one, [P32], batch_size=2),
            backfill_end_user_message_ids(two, [P32], batch_size=2),
        )
        assert sum(a[(32, 2)] for a in added) == len(end_users)
        async with one() as session:
            held = await _end_user_ids(session, 32)
            assert sorted(held) == sorted(end_users)  # exactly one each
            await _unique_per_length(session, 32)
    finally:
        await first.dispose()
        await second.dispose()


async def test_an_activation_past_one_batch_leaves_the_rest_to_the_directorys_backfill(
    scratch_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More end users than one batch: the activation gives the first batch their IDs and hands the
    rest to ``EndUserDirectory.backfill`` (after its commit), which reaches every one."""
    monkeypatch.setattr(service.services.message_ids, "BACKFILL_BATCH", 4)
    settings = make_test_settings(tmp_path, database_url=scratch_url)
    (engine,) = await _engines(tmp_path, scratch_url, 1)
    try:
        sessionmaker = create_sessionmaker(engine)
        end_users = await _end_users_of_a_sixteen_bit_deployment(sessionmaker, 10)
        keyring = Keyring(P32, {"v1": S1, "v2": S2})
        await sync_keyring(keyring, sessionmaker)  # v2 registered (pending); users get 32-bit IDs
        signer = ReportSigner.from_secret(b"end-user backfill test")
        directory = EndUserDirectory(
            sessionmaker=sessionmaker, settings=settings, configured=keyring.spec, signer=signer, cache=EndUserCache(60)
        )
        hooked: list[bool] = []

        def on_end_user_ids(more: bool) -> None:
            hooked.append(more)
            directory.ids_added(more)

        async with session_scope(sessionmaker) as session:
            versions = KeyVersionService(
                Repositories(session), keyring, settings, can_generate=False, on_end_user_ids=on_end_user_ids
            )
            await versions.activate("v2")
            async with sessionmaker() as other:  # not committed yet: nothing handed on
                assert hooked == [] and await _end_user_ids(other, 32) == {}
        await asyncio.sleep(0)  # the hook runs on the loop right after the commit
        assert hooked == [True] and len(directory._backfills) == 1
        await asyncio.wait_for(asyncio.gather(*directory._backfills), 60)  # 5x margin and more: < 1 s here
        async with sessionmaker() as session:
            assert set(await _end_user_ids(session, 32)) == set(end_users)
            await _unique_per_length(session, 32)
        await directory.aclose()
    finally:
        await engine.dispose()


async def test_a_start_up_backfills_the_end_users_of_a_version_registered_then(
    scratch_url: str, tmp_path: Path
) -> None:
    """A 16-bit deployment with end users restarts configured for 32 bits with a second secret: v2
    is registered at start-up, the users get 32-bit IDs before serving, the end users in the
    directory's background backfill (``Resources.end_user_backfill``), apart from every other ID."""
    (engine,) = await _engines(tmp_path, scratch_url, 1)
    try:
        end_users = await _end_users_of_a_sixteen_bit_deployment(create_sessionmaker(engine), 6)
    finally:
        await engine.dispose()
    settings = make_test_settings(tmp_path, database_url=scratch_url, watermark_bits=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", lambda s, metrics: FakeBackend(s.model_name))
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            resources = app.state.resources
            await asyncio.wait_for(asyncio.shield(resources.end_user_backfill), 60)  # 5x margin and more: < 1 s here
            assert resources.keyring.lengths() == {(16, 2), (32, 2)}
            async with resources.sessionmaker() as session:
                assert set(await _end_user_ids(session, 32)) == set(end_users)
                await _unique_per_length(session, 32)
                actors = (
                    await session.scalars(
                        select(RegistryAuditEntry.actor_kind).where(RegistryAuditEntry.action == "message_ids.allocate")
                    )
                ).all()
            assert actors and set(actors) == {"system"}
