"""Many concurrent first sights of a few identifiers on PostgreSQL: exactly one end user per
identifier, exactly one message ID of each length in use per end user, one audit creation each, and
every request answered (``benchmarks/end_users_bench.py`` runs the same race at 10^4 requests)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from sqlalchemy import func, select

from service.config import Settings
from service.db import session_scope
from service.end_users.directory import EndUserCache, EndUserDirectory
from service.end_users.repository import EndUserRepository
from service.models import EndUser, EndUserTally, MessageId, RegistryAuditEntry
from service.repositories.unit import Repositories
from service.schemas.common import Principal
from service.services.users import UserService
from service.vocabulary import Role
from tests.service.conftest import own_database
from tests.service.end_users.test_end_users import _auth, _chat, _started

REQUESTS = 200
IDENTIFIERS = 20


@pytest.mark.postgres
async def test_many_concurrent_first_sights_of_few_identifiers_create_exactly_that_many(settings: Settings) -> None:
    async with own_database(settings, "xmark_end_users_race") as url:
        # the per-user admission limits are above the race, so only the end-user path decides
        raced = settings.model_copy(
            update={
                "database_url": url,
                "user_max_parallel_requests": 0,
                "user_requests_per_minute": 0,
                "user_tokens_per_minute": 0,
                "max_queued_requests": 2 * REQUESTS,
            }
        )
        async for app, client in _started(raced):
            resources = app.state.resources
            async with session_scope(resources.sessionmaker) as session:
                account = await UserService(
                    Repositories(session), resources.keyring.spec, resources.api_key_hasher
                ).create_user("platform", Role.USER)
            lengths = {(m.bits, m.block_bits) for m in account.message_ids}
            # each identifier's requests adjacent: they are all in flight before the first is answered
            identifiers = [f"racer-{i * IDENTIFIERS // REQUESTS}" for i in range(REQUESTS)]
            responses = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=_chat(user=name), headers=_auth(account.api_key))
                    for name in identifiers
                )
            )
            assert Counter(r.status_code for r in responses) == {200: REQUESTS}, [
                r.text for r in responses if r.status_code != 200
            ][:3]
            stamps = {str(stamp.message.bits) for _, stamp in resources.backend.requests[-REQUESTS:]}
            async with session_scope(resources.sessionmaker) as session:
                rows = (await session.scalars(select(EndUser).where(EndUser.user_id == account.id))).all()
                ids = (
                    await session.scalars(select(MessageId).where(MessageId.end_user_id.in_([r.id for r in rows])))
                ).all()
                created = await session.scalar(
                    select(func.count())
                    .select_from(RegistryAuditEntry)
                    .where(
                        RegistryAuditEntry.action == "end_user.create",
                        RegistryAuditEntry.target_id.in_([str(r.id) for r in rows]),
                    )
                )
            assert sorted(r.identifier for r in rows) == sorted(set(identifiers))
            async with session_scope(resources.sessionmaker) as session:
                tally = await session.scalar(select(EndUserTally.total).where(EndUserTally.user_id == account.id))
            assert tally == IDENTIFIERS  # each end user counted once on the account's tally
            per_end_user = Counter((m.end_user_id, m.bits, m.block_bits) for m in ids)
            assert set(per_end_user.values()) == {1}
            assert {(m.end_user_id, (m.bits, m.block_bits)) for m in ids} == {
                (r.id, length) for r in rows for length in lengths
            }
            assert created == IDENTIFIERS
            # every request was generated for its end user: one ID of the encoding length each
            assert len(stamps) == IDENTIFIERS and stamps <= {m.message_id for m in ids}


@pytest.mark.postgres
async def test_two_replicas_racing_for_new_identifiers_create_one_end_user_each(settings: Settings) -> None:
    """Two directories with caches of their own (two replicas of the gateway) resolve the same
    new identifiers at once: the database's lock and unique constraint leave one end user, with
    one message ID per length, for each; both replicas are given that one."""
    async with own_database(settings, "xmark_end_users_replicas") as url:
        async for app, _client in _started(settings.model_copy(update={"database_url": url})):
            resources = app.state.resources
            async with session_scope(resources.sessionmaker) as session:
                account = await UserService(
                    Repositories(session), resources.keyring.spec, resources.api_key_hasher
                ).create_user("platform", Role.USER)
            principal = Principal(user_id=account.id, name="platform", role=Role.USER, api_key_id=1)
            replicas = [
                EndUserDirectory(
                    sessionmaker=resources.sessionmaker,
                    settings=resources.settings,
                    configured=resources.keyring.spec,
                    signer=resources.report_signer,
                    cache=EndUserCache(60.0),
                )
                for _ in range(2)
            ]
            length = (account.message_ids[0].bits, account.message_ids[0].block_bits)
            names = [f"replica-race-{i}" for i in range(10)]
            resolved = await asyncio.gather(
                *(replica.resolve(principal, name, length) for name in names for replica in replicas for _ in range(3))
            )
            async with session_scope(resources.sessionmaker) as session:
                rows = (await session.scalars(select(EndUser).where(EndUser.user_id == account.id))).all()
            assert sorted(r.identifier for r in rows) == sorted(names)
            async with session_scope(resources.sessionmaker) as session:
                tally = await session.scalar(select(EndUserTally.total).where(EndUserTally.user_id == account.id))
            assert tally == len(names)  # a first sight that lost its race took its count back
            by_name = {r.identifier: r.id for r in rows}
            for i, identity in enumerate(resolved):
                assert identity.id == by_name[names[i // 6]]


@pytest.mark.postgres
async def test_a_burst_of_one_new_identifier_takes_the_account_lock_once(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 requests naming one new identifier at once in one process: one of them looks it up (one
    first sight, one lock of the account), the others await its answer; all are generated for it."""
    locks = 0
    count_one_more = EndUserRepository.count_one_more

    async def counted(self: EndUserRepository, user_id: int) -> int:
        nonlocal locks
        locks += 1
        return await count_one_more(self, user_id)

    monkeypatch.setattr(EndUserRepository, "count_one_more", counted)
    async with own_database(settings, "xmark_end_users_burst") as url:
        unlimited = {
            "database_url": url,
            "user_max_parallel_requests": 0,
            "user_requests_per_minute": 0,
            "user_tokens_per_minute": 0,
            "end_user_requests_per_minute": 0,
            "end_user_tokens_per_minute": 0,
            "max_queued_requests": 100,
        }
        async for app, client in _started(settings.model_copy(update=unlimited)):
            resources = app.state.resources
            async with session_scope(resources.sessionmaker) as session:
                account = await UserService(
                    Repositories(session), resources.keyring.spec, resources.api_key_hasher
                ).create_user("platform", Role.USER)
            responses = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=_chat(user="one-burst"), headers=_auth(account.api_key))
                    for _ in range(50)
                )
            )
            assert Counter(r.status_code for r in responses) == {200: 50}
            assert locks == 1
            stamps = {str(stamp.message.bits) for _, stamp in resources.backend.requests[-50:]}
            assert len(stamps) == 1
