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
from service.models import EndUser, MessageId, RegistryAuditEntry
from service.services.users import UserService
from service.vocabulary import Role
from tests.service.conftest import own_database
from tests.service.test_end_users import _auth, _chat, _started

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
                account = await UserService(session, resources.keyring.spec, resources.api_key_hasher).create_user(
                    "platform", Role.USER
                )
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
            per_end_user = Counter((m.end_user_id, m.bits, m.block_bits) for m in ids)
            assert set(per_end_user.values()) == {1}
            assert {(m.end_user_id, (m.bits, m.block_bits)) for m in ids} == {
                (r.id, length) for r in rows for length in lengths
            }
            assert created == IDENTIFIERS
            # every request was generated for its end user: one ID of the encoding length each
            assert len(stamps) == IDENTIFIERS and stamps <= {m.message_id for m in ids}
