"""Message-ID allocation: never reused (tombstones included), retried on concurrent collisions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import ConflictError
from service.models import User
from service.services.users import UserService
from xmark_core import Message, WatermarkParams, allocate_message

TINY = WatermarkParams(bits=2, block_bits=2, num_keys=2)  # four possible IDs


async def test_deleted_users_ids_are_never_reused(app: Any, db_session: AsyncSession) -> None:
    service = UserService(db_session, TINY, app.state.resources.api_key_hasher)
    first = [await service.create_user(f"u{i}", "user") for i in range(3)]
    assert len({u.message_id for u in first}) == 3
    deleted = await service.delete_user(first[0].id)
    assert deleted.status == "deleted"

    fourth = await service.create_user("u3", "user")
    assert fourth.message_id not in {u.message_id for u in first}
    # every ID is now taken, one of them by a tombstone: nothing is recycled
    with pytest.raises(ConflictError) as info:
        await service.create_user("u4", "user")
    assert info.value.code == "message_space_exhausted"
    stored = (await db_session.scalars(select(User.message_id))).all()
    assert sorted(stored) == ["00", "01", "10", "11"]


async def test_ids_are_spread_in_hamming_distance(app: Any, db_session: AsyncSession) -> None:
    params = WatermarkParams()
    service = UserService(db_session, params, app.state.resources.api_key_hasher)
    ids = [(await service.create_user(f"s{i}", "user")).message_id for i in range(8)]
    distance = min(sum(a != b for a, b in zip(x, y, strict=True)) for i, x in enumerate(ids) for y in ids[i + 1 :])
    # best-candidate sampling keeps eight 16-bit IDs at distance >= 7 in 3000 of 3000 trials;
    # uniformly random IDs fall below 4 about a quarter of the time
    assert distance >= 6


async def test_a_concurrent_collision_is_retried(app: Any, db_session: AsyncSession) -> None:
    params = WatermarkParams()
    existing = await UserService(db_session, params, app.state.resources.api_key_hasher).create_user("first", "user")
    calls: list[str] = []

    def racing_allocator(taken: Iterable[str], p: WatermarkParams) -> Message:
        # the first attempt returns an ID another writer stored after our read
        calls.append("call")
        if len(calls) == 1:
            return Message(existing.message_id, p)
        return allocate_message(taken, p)

    service = UserService(db_session, params, app.state.resources.api_key_hasher, allocator=racing_allocator)
    created = await service.create_user("second", "user")
    assert len(calls) == 2
    assert created.message_id != existing.message_id
    rows = (await db_session.scalars(select(User).order_by(User.id))).all()
    assert [r.name for r in rows] == ["first", "second"]


async def test_persistent_collisions_give_up_cleanly(app: Any, db_session: AsyncSession) -> None:
    params = WatermarkParams()
    existing = await UserService(db_session, params, app.state.resources.api_key_hasher).create_user("first", "user")

    def always_taken(_: Iterable[str], p: WatermarkParams) -> Message:
        return Message(existing.message_id, p)

    service = UserService(db_session, params, app.state.resources.api_key_hasher, allocator=always_taken)
    with pytest.raises(ConflictError) as info:
        await service.create_user("second", "user")
    assert info.value.code == "message_id_conflict"
    assert [r.name for r in (await db_session.scalars(select(User))).all()] == ["first"]
