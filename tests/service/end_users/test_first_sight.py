"""An end user's first sight on databases of the test's own (SQLite and PostgreSQL), through the
directory the gateway uses: message IDs drawn ahead (``IdPool``), a drawn ID another transaction
took first, an account found at its cap refused without the lock and the count, and cap refusals
held back (``end_users_refusal_delay_s``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import create_engine, create_sessionmaker, session_scope, upgrade_database
from service.end_users.directory import EndUserCache, EndUserDirectory
from service.end_users.id_pool import IdPool
from service.end_users.repository import EndUserRepository
from service.errors import RateLimitError
from service.models import EndUser, EndUserTally, MessageId, RegistryAuditEntry
from service.repositories.unit import Repositories
from service.schemas.common import Principal
from service.security import ApiKeyHasher
from service.services.reports import ReportSigner
from service.services.users import UserService, allocate_one
from service.vocabulary import Role
from tests.conftest import TEST_API_KEY_PEPPER, make_test_settings
from xmark_core import Message, WatermarkParams

PARAMS = WatermarkParams(bits=32, block_bits=2)
LENGTH = (PARAMS.bits, PARAMS.block_bits)


class Counting:
    """The registry's allocation rule, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, existing: Iterable[str], params: WatermarkParams) -> Message:
        self.calls += 1
        return allocate_one(existing, params)


async def _setup(
    url: str, tmp_path: Path, **settings: Any
) -> tuple[Any, async_sessionmaker[AsyncSession], EndUserDirectory, Principal, Counting]:
    config = make_test_settings(tmp_path, database_url=url, **settings)
    engine = create_engine(config)
    sessionmaker = create_sessionmaker(engine)
    async with session_scope(sessionmaker) as session:
        account = await UserService(
            Repositories(session), PARAMS, ApiKeyHasher(TEST_API_KEY_PEPPER.encode())
        ).create_user("platform", Role.USER)
    allocator = Counting()
    directory = EndUserDirectory(
        sessionmaker=sessionmaker,
        settings=config,
        configured=PARAMS,
        signer=ReportSigner.from_secret(b"first sight test"),
        cache=EndUserCache(60.0),
        allocator=allocator,
    )
    principal = Principal(user_id=account.id, name="platform", role=Role.USER, api_key_id=1)
    return engine, sessionmaker, directory, principal, allocator


async def _ids(sessionmaker: async_sessionmaker[AsyncSession], account_id: int) -> dict[str, list[str]]:
    async with sessionmaker() as session:
        rows = (
            await session.execute(
                select(EndUser.identifier, MessageId.message_id)
                .join(MessageId, MessageId.end_user_id == EndUser.id)
                .where(EndUser.user_id == account_id)
            )
        ).all()
    found: dict[str, list[str]] = {}
    for identifier, message_id in rows:
        found.setdefault(identifier, []).append(message_id)
    return found


async def test_first_sights_take_the_ids_drawn_ahead_without_drawing(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, allocator = await _setup(scratch_url, tmp_path, end_users_ids_ahead=8)
    try:
        # the process's first first sight draws its own ID and starts the pool's refill
        first = await directory.resolve(principal, "eu-0", LENGTH)
        refill = directory.ids.refill([PARAMS])  # the refill under way, if it has not ended
        assert refill is not None
        await refill
        assert directory.ids.held(LENGTH) == 8 and allocator.calls == 1 + 8
        ahead = [m.bits for m in directory.ids._ready[LENGTH]]
        # the next three take the drawn IDs in order: no draw, no read of the registry's IDs
        resolved = [await directory.resolve(principal, f"eu-{i}", LENGTH) for i in range(1, 4)]
        assert allocator.calls == 9
        assert [r.message_id_for(*LENGTH) for r in resolved] == ahead[:3]
        stored = await _ids(sessionmaker, principal.user_id)
        assert stored == {f"eu-{i}": [ahead[i - 1]] for i in range(1, 4)} | {"eu-0": [first.message_id_for(*LENGTH)]}
        # every ID was drawn far from the registered ones and from the others drawn: all distinct
        assert len({i for ids in stored.values() for i in ids}) == 4
        async with sessionmaker() as session:
            created = await session.scalar(
                select(func.count())
                .select_from(RegistryAuditEntry)
                .where(RegistryAuditEntry.action == "end_user.create")
            )
        assert created == 4
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_a_drawn_id_another_transaction_took_first_is_drawn_again(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_ids_ahead=4)
    try:
        await directory.resolve(principal, "eu-0", LENGTH)
        refill = directory.ids.refill([PARAMS])
        assert refill is not None
        await refill
        taken = directory.ids._ready[LENGTH][0].bits
        # another replica's end user holds the next drawn ID before this process inserts it
        async with session_scope(sessionmaker) as session:
            repo = EndUserRepository(session)
            other = await repo.insert(principal.user_id, "other-replica", datetime.now(UTC))
            assert other is not None
            session.add(MessageId(end_user_id=other, bits=PARAMS.bits, block_bits=PARAMS.block_bits, message_id=taken))
        identity = await directory.resolve(principal, "eu-1", LENGTH)
        mine = identity.message_id_for(*LENGTH)
        assert mine is not None and mine != taken
        stored = await _ids(sessionmaker, principal.user_id)
        # the first attempt was rolled back whole: one end user, one ID of the length
        assert stored["eu-1"] == [mine] and stored["other-replica"] == [taken]
        async with sessionmaker() as session:
            named = await session.scalar(select(func.count()).select_from(EndUser).where(EndUser.identifier == "eu-1"))
        assert named == 1
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_an_account_at_its_cap_is_refused_without_the_lock_or_the_count(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(
        scratch_url, tmp_path, end_users_max_per_account=2, end_users_refusal_delay_s=0
    )
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    try:
        for name in ("a", "b"):
            await directory.resolve(principal, name, LENGTH)
        with pytest.raises(RateLimitError) as first_refusal:
            await directory.resolve(principal, "c", LENGTH)
        assert "end_users_max_per_account" in first_refusal.value.message
        event.listen(engine.sync_engine, "before_cursor_execute", seen)
        try:
            with pytest.raises(RateLimitError) as refused:
                await directory.resolve(principal, "d", LENGTH)
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", seen)
        assert refused.value.code == "end_user_limit_exceeded"
        assert "limit of 2 end users (end_users_max_per_account)" in refused.value.message
        # one statement: the read that finds "d" new; no lock, no count
        assert len(statements) == 1 and "count(" not in statements[0].lower(), statements
        # a known end user is still served, and a raised cap is a different cap: counted again
        assert (await directory.resolve(principal, "a", LENGTH)).identifier == "a"
        raised = principal.model_copy(update={"end_users_max": 3})
        assert (await directory.resolve(raised, "d", LENGTH)).identifier == "d"
        assert sorted(await _ids(sessionmaker, principal.user_id)) == ["a", "b", "d"]
    finally:
        await directory.aclose()
        await engine.dispose()


@pytest.mark.parametrize("scratch_url", ["sqlite"], indirect=True)
async def test_cap_refusals_are_held_back_up_to_a_bound(scratch_url: str, tmp_path: Path) -> None:
    delay = 2.0
    engine, _, directory, principal, _ = await _setup(
        scratch_url, tmp_path, end_users_max_per_account=1, end_users_refusal_delay_s=delay, end_users_max_held_back=2
    )
    try:
        await directory.resolve(principal, "a", LENGTH)

        async def refused(name: str) -> float:
            started = time.perf_counter()
            with pytest.raises(RateLimitError):
                await directory.resolve(principal, name, LENGTH)
            return time.perf_counter() - started

        waits = sorted(await asyncio.gather(*(refused(f"new-{i}") for i in range(4))))
        # two held back the whole delay (a lower bound: a slower machine only waits longer); the two
        # past the bound at once (an upper bound of half the delay, over 50x what a refusal takes)
        assert waits[2] >= delay and waits[3] >= delay
        assert waits[1] < delay / 2
        # a request that is served is never held back
        started = time.perf_counter()
        await directory.resolve(principal, "a", LENGTH)
        assert time.perf_counter() - started < delay / 2
    finally:
        await directory.aclose()
        await engine.dispose()


async def _tally(sessionmaker: async_sessionmaker[AsyncSession], account_id: int) -> tuple[int | None, int]:
    """The account's tally and its end users counted."""
    async with sessionmaker() as session:
        tally = await session.scalar(select(EndUserTally.total).where(EndUserTally.user_id == account_id))
        counted = await session.scalar(select(func.count()).select_from(EndUser).where(EndUser.user_id == account_id))
    return tally, int(counted or 0)


async def test_the_tally_counts_each_end_user_once_and_decides_the_cap(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(
        scratch_url, tmp_path, end_users_max_per_account=4, end_users_refusal_delay_s=0
    )
    try:
        # two end users from before the account had a tally row (as after migration 0015, which
        # fills it; or rows written around the directory)
        async with session_scope(sessionmaker) as session:
            repo = EndUserRepository(session)
            for name in ("old-1", "old-2"):
                assert await repo.insert(principal.user_id, name, datetime.now(UTC)) is not None
        assert await _tally(sessionmaker, principal.user_id) == (None, 2)
        await directory.resolve(principal, "new-1", LENGTH)
        assert await _tally(sessionmaker, principal.user_id) == (3, 3)  # the count, then one more
        # a known end user read by another replica (its cache is cold) counts nothing
        replica = EndUserDirectory(
            sessionmaker=sessionmaker,
            settings=directory._settings,
            configured=PARAMS,
            signer=ReportSigner.from_secret(b"first sight test"),
            cache=EndUserCache(60.0),
        )
        await replica.resolve(principal, "new-1", LENGTH)
        await directory.resolve(principal, "new-2", LENGTH)
        assert await _tally(sessionmaker, principal.user_id) == (4, 4)
        # at the cap: refused, and the tally's count was rolled back with it
        with pytest.raises(RateLimitError):
            await replica.resolve(principal, "new-3", LENGTH)
        assert await _tally(sessionmaker, principal.user_id) == (4, 4)
        # deleting an end user frees nothing: deleted ones count (the row stays a tombstone)
        async with session_scope(sessionmaker) as session:
            row = await session.scalar(select(EndUser).where(EndUser.identifier == "old-1"))
            assert row is not None
            row.status = "deleted"
        with pytest.raises(RateLimitError):
            await directory.resolve(principal.model_copy(update={"end_users_max": 4}), "new-4", LENGTH)
        assert await _tally(sessionmaker, principal.user_id) == (4, 4)
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_the_last_minute_is_counted_only_once_the_account_has_that_many(scratch_url: str, tmp_path: Path) -> None:
    """New end users of the last minute are at most all of the account's: below the per-minute cap
    in all, the first sight reads no count; at it, the count decides."""
    engine, sessionmaker, directory, principal, _ = await _setup(
        scratch_url, tmp_path, end_users_new_per_minute=2, end_users_refusal_delay_s=0
    )
    counts: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "count(" in statement.lower() and "created_at >=" in statement:  # the last minute's count
            counts.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", seen)
    try:
        for name in ("a", "b"):
            await directory.resolve(principal, name, LENGTH)
        assert counts == []
        with pytest.raises(RateLimitError) as refused:
            await directory.resolve(principal, "c", LENGTH)
        assert "limit of 2 new end users per minute (end_users_new_per_minute)" in refused.value.message
        assert len(counts) == 1
        # the same account with the minute's cap lifted: counted again, and created
        lifted = principal.model_copy(update={"end_users_new_per_minute": 0})
        assert (await directory.resolve(lifted, "c", LENGTH)).identifier == "c"
        assert await _tally(sessionmaker, principal.user_id) == (3, 3)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", seen)
        await directory.aclose()
        await engine.dispose()


def _lowest_free(existing: Iterable[str], params: WatermarkParams) -> Message:
    """An allocation rule that draws the lowest ID not taken: what a refill draws is then known."""
    taken = set(existing)
    value = next(v for v in range(1 << params.bits) if format(v, f"0{params.bits}b") not in taken)
    return Message(format(value, f"0{params.bits}b"), params)


async def test_a_refill_draws_away_from_the_ids_taken_while_it_read_the_registry(tmp_path: Path) -> None:
    """IDs are drawn away from every registered ID, from those held, and from those taken lately (a
    first sight may not have committed one when the refill reads the registry)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    await asyncio.to_thread(upgrade_database, url)
    engine = create_engine(make_test_settings(tmp_path, database_url=url))
    try:
        params = WatermarkParams(bits=4, block_bits=2)
        pool = IdPool(create_sessionmaker(engine), _lowest_free, size=3, low_water=0)
        refill = pool.refill([params])
        assert refill is not None
        await refill
        assert [m.bits for m in pool._ready[(4, 2)]] == ["0000", "0001", "0010"]
        first = pool.take([params])  # taken, not yet in the registry
        assert first is not None and first[0].bits == "0000"
        refill = pool.refill([params])  # tops the pool up to 3 again
        assert refill is not None
        await refill
        assert [m.bits for m in pool._ready[(4, 2)]] == ["0001", "0010", "0011"]
    finally:
        await engine.dispose()
