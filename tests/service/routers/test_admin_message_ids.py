"""Message-ID allocation: one ID per message length in use, never reused (tombstones included),
retried on concurrent collisions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import ConflictError
from service.models import KeyVersion, MessageId, User
from service.repositories.unit import Repositories
from service.schemas.admin import CreatedUser
from service.services import users as users_module
from service.services.users import UserService
from xmark_core import Message, WatermarkParams, allocate_message

TINY = WatermarkParams(bits=2, block_bits=2, num_keys=2)  # four possible IDs
SIXTEEN = WatermarkParams(bits=16)


def id_of(created: CreatedUser, params: WatermarkParams) -> str:
    return next(m.message_id for m in created.message_ids if (m.bits, m.block_bits) == (params.bits, params.block_bits))


async def test_deleted_users_ids_are_never_reused(app: Any, db_session: AsyncSession) -> None:
    service = UserService(Repositories(db_session), TINY, app.state.resources.api_key_hasher)
    first = [await service.create_user(f"u{i}", "user") for i in range(3)]
    assert len({id_of(u, TINY) for u in first}) == 3
    deleted = await service.delete_user(first[0].id)
    assert deleted.status == "deleted"

    fourth = await service.create_user("u3", "user")
    assert id_of(fourth, TINY) not in {id_of(u, TINY) for u in first}
    # every ID is now taken, one of them by a tombstone: nothing is recycled
    with pytest.raises(ConflictError) as info:
        await service.create_user("u4", "user")
    assert info.value.code == "message_space_exhausted"
    stored = (await db_session.scalars(select(User.message_id))).all()  # the ID of the configured length
    assert sorted(stored) == ["00", "01", "10", "11"]
    tiny = (await db_session.scalars(select(MessageId.message_id).where(MessageId.bits == 2))).all()
    assert sorted(tiny) == ["00", "01", "10", "11"]


async def test_a_user_gets_one_id_per_length_in_use(app: Any, db_session: AsyncSession) -> None:
    """The lengths of the non-retired key versions plus the configured one; ``message_id`` is the
    one of the active version's length."""
    versions = (await db_session.scalars(select(KeyVersion))).all()
    in_use = {(v.bits, v.block_bits) for v in versions if v.status != "retired"}
    service = UserService(Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher)
    created = await service.create_user("multi", "user")
    lengths = [(m.bits, m.block_bits) for m in created.message_ids]
    assert lengths == sorted(in_use | {(16, 2)})
    active = app.state.resources.keyring.active().key.params
    assert created.message_id == id_of(created, active)
    row = await db_session.get(User, created.id)
    assert row is not None and row.message_id == id_of(created, SIXTEEN)  # the length it was created with
    fetched = await service.get_user(created.id)
    assert fetched.message_id == created.message_id and fetched.message_ids == created.message_ids

    # a retired version's length is no longer in use: later users get no ID of it
    for version in versions:
        if (version.bits, version.block_bits) != (active.bits, active.block_bits):
            version.status = "retired"
    db_session.add(KeyVersion(**_row_like(versions[0], name="old-8", bits=8, status="retired")))
    await db_session.flush()
    later = await service.create_user("later", "user")
    assert {(m.bits, m.block_bits) for m in later.message_ids} == {(16, 2), (active.bits, active.block_bits)}


def _row_like(row: KeyVersion, **changes: Any) -> dict[str, Any]:
    values = {c.key: getattr(row, c.key) for c in KeyVersion.__table__.columns if c.key != "id"}
    values.update(changes)
    return values


async def test_ids_are_spread_in_hamming_distance(app: Any, db_session: AsyncSession) -> None:
    service = UserService(Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher)
    ids = [id_of(await service.create_user(f"s{i}", "user"), SIXTEEN) for i in range(8)]
    distance = min(sum(a != b for a, b in zip(x, y, strict=True)) for i, x in enumerate(ids) for y in ids[i + 1 :])
    # best-candidate sampling keeps eight 16-bit IDs at distance >= 7 in 3000 of 3000 trials;
    # uniformly random IDs fall below 4 about a quarter of the time
    assert distance >= 6


async def test_a_concurrent_collision_is_retried(app: Any, db_session: AsyncSession) -> None:
    existing = await UserService(Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher).create_user(
        "first", "user"
    )
    calls: list[int] = []

    def racing_allocator(taken: Iterable[str], p: WatermarkParams) -> Message:
        # the first attempt's 16-bit ID is one another writer stored after our read
        calls.append(p.bits)
        if calls == [16]:
            return Message(id_of(existing, p), p)
        return allocate_message(taken, p)

    service = UserService(
        Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher, allocator=racing_allocator
    )
    created = await service.create_user("second", "user")
    per_attempt = len(created.message_ids)
    assert len(calls) == 2 * per_attempt  # every length is allocated again on the second attempt
    for m in created.message_ids:
        assert m.message_id != next(e.message_id for e in existing.message_ids if e.bits == m.bits)
    rows = (await db_session.scalars(select(User).order_by(User.id))).all()
    assert [r.name for r in rows] == ["first", "second"]
    held = (await db_session.scalars(select(MessageId).where(MessageId.user_id == created.id))).all()
    assert len(held) == per_attempt  # nothing of the failed attempt stayed


async def test_persistent_collisions_give_up_cleanly(app: Any, db_session: AsyncSession) -> None:
    existing = await UserService(Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher).create_user(
        "first", "user"
    )

    def always_taken(_: Iterable[str], p: WatermarkParams) -> Message:
        return Message(id_of(existing, p), p)

    service = UserService(Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher, allocator=always_taken)
    with pytest.raises(ConflictError) as info:
        await service.create_user("second", "user")
    assert info.value.code == "message_id_conflict"
    assert [r.name for r in (await db_session.scalars(select(User))).all()] == ["first"]
    assert {r.user_id for r in (await db_session.scalars(select(MessageId))).all()} == {existing.id}


async def test_a_large_registry_draws_ids_without_reading_them(
    app: Any, db_session: AsyncSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SPREAD_ALLOCATION_LIMIT rows, a 32-bit ID is drawn without reading the allocated ones
    (the allocator sees none); a draw that is taken is refused by the unique constraints and drawn
    again. A 16-bit length keeps reading them (its space is small enough to fill)."""
    thirty_two = WatermarkParams(bits=32)
    existing = await UserService(Repositories(db_session), thirty_two, app.state.resources.api_key_hasher).create_user(
        "a", "user"
    )
    monkeypatch.setattr(users_module, "SPREAD_ALLOCATION_LIMIT", 1)
    seen: list[tuple[int, int]] = []

    def drawing(taken: Iterable[str], p: WatermarkParams) -> Message:
        taken = list(taken)
        seen.append((p.bits, len(taken)))
        if len(seen) == 1 and p.bits == 32:  # the first draw hits the existing user's ID
            return Message(id_of(existing, p), p)
        return allocate_message(taken, p)

    service = UserService(Repositories(db_session), thirty_two, app.state.resources.api_key_hasher, allocator=drawing)
    created = await service.create_user("b", "user")
    assert [taken for bits, taken in seen if bits >= 17] and all(taken == 0 for bits, taken in seen if bits >= 17)
    assert [bits for bits, _ in seen].count(32) == 2  # drawn again after the unique constraint refused the first
    assert id_of(created, thirty_two) != id_of(existing, thirty_two)
    await UserService(Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher).create_user("c", "user")
    seen.clear()
    await UserService(
        Repositories(db_session), SIXTEEN, app.state.resources.api_key_hasher, allocator=drawing
    ).create_user("d", "user")
    assert any(bits == 16 and taken > 0 for bits, taken in seen)
