"""End-user slots reserved ahead (``service.end_users.reserve``) on databases of the test's own
(SQLite and PostgreSQL), through the directory the gateway uses: a first sight takes a slot with
one statement on the request path and is claimed in the background, with its audit entry; a slot
names nobody in the registry until it is claimed; a first sight another replica won first is merged
into its end user; the caps count slots; unused slots are given back when the process stops."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select, update

import service.end_users.reserve as reserve_module
from service.db import session_scope
from service.end_users.directory import EndUserCache, EndUserDirectory
from service.end_users.repository import EndUserRepository
from service.end_users.reserve import STALE_SLOT_S
from service.errors import RateLimitError
from service.models import EndUser, EndUserTally, MessageId, RegistryAuditEntry
from service.repositories.registry import RegistryRepository
from service.services.registry_cache import build_snapshot
from service.services.reports import ReportSigner
from tests.conftest import make_test_settings
from tests.service.end_users.test_first_sight import LENGTH, PARAMS, Counting, _setup


async def _rows(sessionmaker: Any, account_id: int) -> list[tuple[int, str | None, str, int | None]]:
    async with sessionmaker() as session:
        rows = await session.execute(
            select(EndUser.id, EndUser.identifier, EndUser.status, EndUser.merged_into)
            .where(EndUser.user_id == account_id)
            .order_by(EndUser.id)
        )
        return [tuple(r) for r in rows.all()]


async def _tally(sessionmaker: Any, account_id: int) -> int:
    async with sessionmaker() as session:
        return int(await session.scalar(select(EndUserTally.total).where(EndUserTally.user_id == account_id)) or 0)


async def _named(sessionmaker: Any) -> dict[str, tuple[int | None, str | None]]:
    """Each registered end-user ID of ``PARAMS``'s length -> the end user the registry names."""
    async with sessionmaker() as session:
        entries = await RegistryRepository(session).entries_after(PARAMS.bits, PARAMS.block_bits, 0)
    return {e.message_id: (e.end_user_id, e.identifier) for _, e in entries if e.end_user_id is not None}


async def _slots_reserved(directory: EndUserDirectory, principal: Any) -> None:
    """The account's first first sight in this process (``eu-0``), and the slots it reserves."""
    await directory.resolve(principal, "eu-0", LENGTH)
    refill = directory.reserve.refilling(principal.user_id)
    assert refill is not None
    await refill


async def test_a_first_sight_takes_a_slot_with_one_statement_and_is_claimed_after(
    scratch_url: str, tmp_path: Path
) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=4)
    try:
        # the process's first first sight: the session path, which reserves the account's slots
        first = await directory.resolve(principal, "eu-0", LENGTH, request_id="req-0")
        refill, reading = directory.reserve.refilling(principal.user_id), directory.known.reading(principal.user_id)
        assert refill is not None and reading is not None
        await asyncio.gather(refill, reading)
        assert directory.reserve.held(principal.user_id) == 4
        rows = await _rows(sessionmaker, principal.user_id)
        slots = [r for r in rows if r[2] == "reserved"]
        assert len(slots) == 4 and all(r[1] is None for r in slots)
        assert await _tally(sessionmaker, principal.user_id) == 1 + 4
        # a reserved slot's ID names nobody yet
        named = await _named(sessionmaker)
        assert set(named) == {first.message_id_for(*LENGTH)}

        statements: list[str] = []

        def executed(*args: Any) -> None:
            statements.append(args[2])

        event.listen(engine.sync_engine, "before_cursor_execute", executed)
        second = await directory.resolve(principal, "eu-1", LENGTH, request_id="req-1")
        on_path = list(statements)
        event.remove(engine.sync_engine, "before_cursor_execute", executed)
        # no statement on the request path (the account's identifiers are known, this one is not
        # among them); the answer is the first slot's
        assert on_path == []
        assert second.id == slots[0][0]
        assert await directory.settled(second.id) == second.id  # waits for the claim
        rows = await _rows(sessionmaker, principal.user_id)
        assert (second.id, "eu-1", "active", None) in rows
        # claimed: its ID now names the end user (its rows written again, the same values)
        named = await _named(sessionmaker)
        assert named[second.message_id_for(*LENGTH)] == (second.id, "eu-1")
        async with sessionmaker() as session:
            entry = (
                await session.execute(
                    select(RegistryAuditEntry).where(
                        RegistryAuditEntry.action == "end_user.create", RegistryAuditEntry.target_id == str(second.id)
                    )
                )
            ).scalar_one()
        assert entry.request_id == "req-1" and entry.actor_kind == "api"
        assert entry.changes["after"]["identifier"] == "eu-1"
        assert entry.changes["after"]["message_ids"][0]["message_id"] == second.message_id_for(*LENGTH)
        # known now: the cache answers with no statement, the same end user
        assert await directory.resolve(principal, "eu-1", LENGTH) == second
        # not cached, but known: one read outside a transaction, the same end user, no slot taken
        directory.cache.clear()
        held = directory.reserve.held(principal.user_id)
        event.listen(engine.sync_engine, "before_cursor_execute", executed)
        again = await directory.resolve(principal, "eu-0", LENGTH)
        on_path = statements[len(on_path) :]
        event.remove(engine.sync_engine, "before_cursor_execute", executed)
        assert len(on_path) == 1 and on_path[0].lstrip().upper().startswith("SELECT"), on_path
        assert again == first and directory.reserve.held(principal.user_id) == held
        # the admin's listing shows end users, never slots
        async with sessionmaker() as session:
            page, total = await EndUserRepository(session).page(principal.user_id, limit=50, offset=0)
        assert sorted(r.identifier or "" for r in page) == ["eu-0", "eu-1"] and total == 2
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_a_first_sight_another_replica_won_is_merged_into_its_end_user(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=2)
    try:
        await _slots_reserved(directory, principal)
        claim_once = directory._claim_once
        winner: list[int] = []

        async def other_replica_first(*args: Any) -> int:
            # another replica's first sight of the same identifier commits between this process's
            # probe (which found nothing) and its claim
            async with session_scope(sessionmaker) as session:
                repo = EndUserRepository(session)
                won = await repo.insert(principal.user_id, "eu-raced", datetime.now(UTC))
                assert won is not None
                session.add(
                    MessageId(end_user_id=won, bits=PARAMS.bits, block_bits=PARAMS.block_bits, message_id="1" * 32)
                )
                winner.append(won)
            return await claim_once(*args)

        directory._claim_once = other_replica_first  # type: ignore[method-assign]
        raced = await directory.resolve(principal, "eu-raced", LENGTH, request_id="req-raced")
        settled = await directory.settled(raced.id)
        assert settled == winner[0] != raced.id
        rows = await _rows(sessionmaker, principal.user_id)
        assert (raced.id, None, "merged", winner[0]) in rows
        # the texts encoded with the slot's ID name the end user it was merged into: the registry
        # holds the slot's ID under the slot row (a holder per ID), named as that end user
        named = await _named(sessionmaker)
        assert named[raced.message_id_for(*LENGTH)] == (raced.id, "eu-raced")
        assert named["1" * 32] == (winner[0], "eu-raced")
        async with sessionmaker() as session:
            entries = [e for _, e in await RegistryRepository(session).entries_after(PARAMS.bits, PARAMS.block_bits, 0)]
        holders = build_snapshot(entries, PARAMS).users
        assert holders[-raced.id].end_user_id == winner[0] and holders[-raced.id].identifier == "eu-raced"
        assert holders[-winner[0]].end_user_id == winner[0]
        async with sessionmaker() as session:
            merges = (
                await session.scalars(select(RegistryAuditEntry).where(RegistryAuditEntry.action == "end_user.merge"))
            ).all()
        assert [(m.target_id, m.changes["after"]["merged_into"], m.request_id) for m in merges] == [
            (str(raced.id), winner[0], "req-raced")
        ]
        # this process now answers with the winner
        directory._claim_once = claim_once  # type: ignore[method-assign]
        again = await directory.resolve(principal, "eu-raced", LENGTH)
        assert again.id == winner[0] and again.message_id_for(*LENGTH) == "1" * 32
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_slots_count_within_the_caps_and_are_given_back_unused(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(
        scratch_url, tmp_path, end_users_reserve=8, end_users_max_per_account=3, end_users_refusal_delay_s=0
    )
    try:
        await _slots_reserved(directory, principal)
        # room for two more under the cap of 3: two slots, not eight
        assert directory.reserve.held(principal.user_id) == 2
        assert await _tally(sessionmaker, principal.user_id) == 3
        taken = [await directory.resolve(principal, f"eu-{i}", LENGTH) for i in (1, 2)]
        assert all([await directory.settled(t.id) == t.id for t in taken])
        try:
            await directory.resolve(principal, "eu-3", LENGTH)
        except RateLimitError as refused:
            assert refused.code == "end_user_limit_exceeded"
        else:
            raise AssertionError("a fourth end user passed a cap of 3")
        rows = await _rows(sessionmaker, principal.user_id)
        assert sorted(r[1] for r in rows if r[1] is not None) == ["eu-0", "eu-1", "eu-2"]
    finally:
        await directory.aclose()
        await engine.dispose()

    # a process stopping gives its unused slots back: off the tally, their IDs kept
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=3)
    try:
        await _slots_reserved(directory, principal)
        assert await _tally(sessionmaker, principal.user_id) == 4
    finally:
        await directory.aclose()
    rows = await _rows(sessionmaker, principal.user_id)
    assert sorted(r[2] for r in rows) == ["active", "void", "void", "void"]  # the refill may commit first
    assert await _tally(sessionmaker, principal.user_id) == 1
    async with sessionmaker() as session:
        kept = await session.scalar(
            select(func.count())
            .select_from(MessageId)
            .join(EndUser, EndUser.id == MessageId.end_user_id)
            .where(EndUser.user_id == principal.user_id)
        )
    assert kept == 4
    await engine.dispose()


async def test_concurrent_first_sights_of_one_identifier_take_one_slot(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=4)
    try:
        await _slots_reserved(directory, principal)
        burst = await asyncio.gather(*(directory.resolve(principal, f"eu-{i % 3 + 1}", LENGTH) for i in range(30)))
        assert len({b.id for b in burst}) == 3
        for b in burst:
            assert await directory.settled(b.id) == b.id
        rows = await _rows(sessionmaker, principal.user_id)
        assert sorted(r[1] for r in rows if r[1] is not None) == ["eu-0", "eu-1", "eu-2", "eu-3"]
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_another_replicas_end_user_is_read_once_the_knowledge_is_refreshed(
    scratch_url: str, tmp_path: Path
) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=2)
    try:
        await directory.resolve(principal, "eu-0", LENGTH)
        refill, reading = directory.reserve.refilling(principal.user_id), directory.known.reading(principal.user_id)
        assert refill is not None and reading is not None
        await asyncio.gather(refill, reading)
        assert directory.known.surely_new(principal.user_id, "eu-other")
        assert not directory.known.surely_new(principal.user_id, "eu-0")
        # another replica creates an end user; this process's knowledge learns it on its next read
        async with session_scope(sessionmaker) as session:
            other = await EndUserRepository(session).insert(principal.user_id, "eu-other", datetime.now(UTC))
            assert other is not None
            session.add(
                MessageId(end_user_id=other, bits=PARAMS.bits, block_bits=PARAMS.block_bits, message_id="1" * 32)
            )
        directory.known._accounts[principal.user_id].fresh_at = -1e9  # as if refresh_s had passed
        assert not directory.known.surely_new(principal.user_id, "eu-other")  # stale: not trusted; a read starts
        reading = directory.known.reading(principal.user_id)
        assert reading is not None
        await reading
        assert not directory.known.surely_new(principal.user_id, "eu-other")
        found = await directory.resolve(principal, "eu-other", LENGTH)
        assert found.id == other and directory.reserve.held(principal.user_id) == 2  # read, no slot taken
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_a_burst_of_new_identifiers_is_served_by_refills_sized_to_it(scratch_url: str, tmp_path: Path) -> None:
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=4)
    try:
        await _slots_reserved(directory, principal)
        first_sights = directory._first_sight
        on_the_request_path: list[str] = []

        async def counted(*args: Any) -> Any:
            on_the_request_path.append(args[3])
            return await first_sights(*args)

        directory._first_sight = counted  # type: ignore[method-assign]
        burst = await asyncio.gather(*(directory.resolve(principal, f"burst-{i}", LENGTH) for i in range(40)))
        assert len({b.id for b in burst}) == 40
        assert [await directory.settled(b.id) for b in burst] == [b.id for b in burst]
        # the first sights that found no slot waited for a refill reserving for them: none (or a
        # few, where a refill was cut short) took the account's lock on the request path
        assert len(on_the_request_path) <= 4, on_the_request_path
        rows = await _rows(sessionmaker, principal.user_id)
        assert sorted(r[1] for r in rows if r[1] is not None) == sorted(["eu-0", *(f"burst-{i}" for i in range(40))])
        assert await _tally(sessionmaker, principal.user_id) == len([r for r in rows if r[2] in ("active", "reserved")])
    finally:
        await directory.aclose()
        await engine.dispose()


async def test_an_identifier_added_while_the_identifiers_are_read_stays_known(scratch_url: str, tmp_path: Path) -> None:
    """A first sight of this process adds its identifier at once; a read of the account's identifiers
    that ran before it committed does not drop it (else the next cache miss would take a slot again)."""
    engine, _, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=2)
    try:
        directory.known.want(principal.user_id)
        directory.known.add(principal.user_id, "not-committed-yet")
        reading = directory.known.reading(principal.user_id)
        assert reading is not None
        await reading
        assert not directory.known.surely_new(principal.user_id, "not-committed-yet")
        assert directory.known.surely_new(principal.user_id, "never-seen")
    finally:
        await directory.aclose()
        await engine.dispose()


def _another_process(sessionmaker: Any, tmp_path: Path, url: str, **settings: Any) -> EndUserDirectory:
    """A directory of another process of the gateway on the same database."""
    return EndUserDirectory(
        sessionmaker=sessionmaker,
        settings=make_test_settings(tmp_path, database_url=url, **settings),
        configured=PARAMS,
        signer=ReportSigner.from_secret(b"first sight test"),
        cache=EndUserCache(60.0),
        allocator=Counting(),
    )


async def _refused_by_another_process(sessionmaker: Any, tmp_path: Path, url: str, principal: Any, **cap: Any) -> None:
    """Another process of the gateway, on the request path (no slots of its own), refuses a new
    identifier of the account at its cap."""
    other = _another_process(sessionmaker, tmp_path, url, end_users_reserve=0, **cap)
    try:
        with pytest.raises(RateLimitError):
            await other.resolve(principal, "eu-1", LENGTH)
    finally:
        await other.aclose()


async def _unrenewed_for_an_hour(sessionmaker: Any, slot_ids: list[int]) -> None:
    """The slots' rows as if last renewed past ``STALE_SLOT_S`` ago."""
    async with session_scope(sessionmaker) as session:
        await session.execute(
            update(EndUser)
            .where(EndUser.id.in_(slot_ids))
            .values(last_seen_at=datetime.now(UTC) - timedelta(seconds=STALE_SLOT_S + 60))
        )


async def _counted_rows(sessionmaker: Any, account_id: int) -> int:
    rows = await _rows(sessionmaker, account_id)
    return len([r for r in rows if r[2] not in ("void", "merged")])


async def test_slots_a_killed_process_left_are_given_back_once_stale_at_the_cap(
    scratch_url: str, tmp_path: Path
) -> None:
    """A process killed before it gave its slots back leaves them reserved and counted. While they
    were renewed within ``STALE_SLOT_S`` (a live process may still hold them) the account stays at
    its cap; once not renewed for longer, the first sight or the reservation that finds the account
    at its cap gives them back, and the tally stays the count of the account's rows."""
    cap = {"end_users_max_per_account": 4, "end_users_refusal_delay_s": 0}
    engine, sessionmaker, killed, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=8, **cap)
    try:
        await _slots_reserved(killed, principal)
        assert killed.reserve.held(principal.user_id) == 3  # room for 3 under the cap of 4
        # killed: never ``aclose``d, so its 3 slots stay reserved and counted
        left = [r[0] for r in await _rows(sessionmaker, principal.user_id) if r[2] == "reserved"]
        assert len(left) == 3 and await _tally(sessionmaker, principal.user_id) == 4

        # a second process, on the request path (no slots of its own): young slots keep the cap
        await _refused_by_another_process(sessionmaker, tmp_path, scratch_url, principal, **cap)
        assert [r[0] for r in await _rows(sessionmaker, principal.user_id) if r[2] == "reserved"] == left

        # an hour on, never renewed: past any holder's lease and a claim's retries
        await _unrenewed_for_an_hour(sessionmaker, left)
        third = _another_process(sessionmaker, tmp_path, scratch_url, end_users_reserve=0, **cap)
        try:
            served = await third.resolve(principal, "eu-1", LENGTH)
        finally:
            await third.aclose()
        rows = await _rows(sessionmaker, principal.user_id)
        assert [r[2] for r in rows if r[0] in left] == ["void"] * 3  # their message IDs stay reserved
        assert (served.id, "eu-1", "active", None) in rows
        assert (
            await _tally(sessionmaker, principal.user_id) == await _counted_rows(sessionmaker, principal.user_id) == 2
        )

        # the same on the reservation's path: a process reserving slots for the account at its cap
        async with session_scope(sessionmaker) as session:
            slot_ids = await EndUserRepository(session).insert_slots(
                principal.user_id, 2, datetime.now(UTC) - timedelta(seconds=STALE_SLOT_S + 60)
            )
            await EndUserRepository(session).count_one_more(principal.user_id, 2)
        assert await _tally(sessionmaker, principal.user_id) == 4  # at the cap again, by 2 stale slots
        fourth = _another_process(sessionmaker, tmp_path, scratch_url, end_users_reserve=8, **cap)
        try:
            fourth.reserve.want(principal.user_id, (4, 0), (PARAMS,))
            refill = fourth.reserve.refilling(principal.user_id)
            assert refill is not None
            await refill
            assert fourth.reserve.held(principal.user_id) == 2  # the room the stale slots held
            rows = await _rows(sessionmaker, principal.user_id)
            assert [r[2] for r in rows if r[0] in slot_ids] == ["void", "void"]
            assert await _tally(sessionmaker, principal.user_id) == await _counted_rows(sessionmaker, principal.user_id)
            assert await _tally(sessionmaker, principal.user_id) == 4  # eu-0, eu-1 and the 2 new slots
        finally:
            await fourth.aclose()
    finally:
        for task in list(killed.reserve._voids):
            task.cancel()
        await engine.dispose()


async def test_a_slot_past_its_lease_is_given_back_not_given_out(
    scratch_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process gives a slot out only within ``SLOT_LEASE_S`` of its reservation (so a slot
    ``STALE_SLOT_S`` old is surely no process's to give): an older one is given back, and the first
    sight gets a slot of its own."""
    engine, sessionmaker, directory, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=2)
    try:
        await _slots_reserved(directory, principal)
        old = [r[0] for r in await _rows(sessionmaker, principal.user_id) if r[2] == "reserved"]
        assert len(old) == 2
        # the lease passes (0 s: every slot held is past it)
        monkeypatch.setattr(reserve_module, "SLOT_LEASE_S", 0.0)
        served = await directory.resolve(principal, "eu-1", LENGTH)
        assert served.id not in old
        assert await directory.settled(served.id) == served.id
        # the background work the first sight started ends before the rows and the tally are read
        refill = directory.reserve.refilling(principal.user_id)
        await asyncio.gather(*directory.reserve._voids, *([refill] if refill is not None else []))
        rows = await _rows(sessionmaker, principal.user_id)
        assert [r[2] for r in rows if r[0] in old] == ["void", "void"]
        assert (served.id, "eu-1", "active", None) in rows
        assert await _tally(sessionmaker, principal.user_id) == await _counted_rows(sessionmaker, principal.user_id)
    finally:
        await directory.aclose()
        await engine.dispose()


def test_a_stale_slot_is_past_every_holders_lease_and_claim() -> None:
    from service.end_users.directory import CLAIM_RETRY_S

    # a holder gives a slot out until SLOT_LEASE_S, its claim is retried CLAIM_RETRY_S more; the rest
    # is for replicas' clocks
    assert reserve_module.STALE_SLOT_S >= reserve_module.SLOT_LEASE_S + CLAIM_RETRY_S + 600


async def test_a_live_process_renews_its_slots_so_none_is_taken_for_a_killed_ones(
    scratch_url: str, tmp_path: Path
) -> None:
    """The slots a live process holds are renewed (``Reserve.renew``, every ``RENEW_S``): their rows
    read as recent however old their reservation, another process at the account's cap leaves them
    reserved, and their leases start again."""
    cap = {"end_users_max_per_account": 3, "end_users_refusal_delay_s": 0}
    engine, sessionmaker, holder, principal, _ = await _setup(scratch_url, tmp_path, end_users_reserve=8, **cap)
    try:
        await _slots_reserved(holder, principal)
        held = [r[0] for r in await _rows(sessionmaker, principal.user_id) if r[2] == "reserved"]
        assert len(held) == 2
        # reserved over an hour ago, as far as the rows tell
        await _unrenewed_for_an_hour(sessionmaker, held)
        leased = [slot.leased_at for slot in holder.reserve._accounts[principal.user_id].slots]
        await holder.reserve.renew()
        assert all(
            slot.leased_at > before
            for slot, before in zip(holder.reserve._accounts[principal.user_id].slots, leased, strict=True)
        )
        await _refused_by_another_process(sessionmaker, tmp_path, scratch_url, principal, **cap)
        rows = await _rows(sessionmaker, principal.user_id)
        assert [r[2] for r in rows if r[0] in held] == ["reserved", "reserved"]
        # still the holder's to give out
        taken = await holder.resolve(principal, "eu-2", LENGTH)
        assert taken.id == held[0] and await holder.settled(taken.id) == taken.id
    finally:
        await holder.aclose()
        await engine.dispose()
