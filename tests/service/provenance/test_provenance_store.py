"""The generation log's sketches in the database: written with every record (the spool included),
searched on PostgreSQL (GIN, planner statistics) and SQLite (postings kept by triggers), purged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool

from service.db import upgrade_database
from service.models import Generation, KeyVersion, User
from service.provenance.retrieval import LoggedSketch, MemoryIndex
from service.provenance.search import (
    NOT_FOUND_NOTE,
    RIVAL_NOTE,
    ProvenanceSearch,
    purge_sketches,
)
from service.provenance.sketch import (
    LEGACY_MINHASH_SIZE,
    MINHASH_SIZE,
    QUERY_TERM_LIMIT,
    Sketcher,
    derive_sketch_key,
    minhash_similarity,
    sketch_columns,
)
from service.repositories.provenance import ProvenanceRepository
from service.trace.policy import TracePolicy
from tests.service.provenance.test_provenance_sketch import ORIGINAL, PARAPHRASE, UNRELATED

SKETCHER = Sketcher(derive_sketch_key(b"provenance-store-secret-0123456789"))


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _seed(session: AsyncSession, texts: list[str], *, created_at: datetime | None = None) -> list[int]:
    """A user, a key version and one generation row per text (with its sketch); their row ids."""
    tag = datetime.now(UTC).strftime("%H%M%S%f")
    user = User(name="sketch-owner", role="user", message_id=f"{tag:0>32}"[:32])
    version = KeyVersion(
        name=f"kv-{tag}",
        bits=32,
        block_bits=2,
        num_keys=4,
        delta=2.0,
        scheme="xmark",
        fingerprint="f" * 64,
        status="retired",
    )
    session.add_all([user, version])
    await session.flush()
    rows = [
        Generation(
            request_id=f"req-{tag}-{i}",
            user_id=user.id,
            key_version_id=version.id,
            model="m",
            prompt_tokens=1,
            completion_tokens=1,
            completion_sha256="0" * 64,
            created_at=created_at or datetime.now(UTC),
            **sketch_columns(SKETCHER, body),
        )
        for i, body in enumerate(texts)
    ]
    session.add_all(rows)
    await session.flush()
    return [row.id for row in rows]


@pytest.fixture
async def sqlite_session(sqlite_url: str) -> AsyncIterator[AsyncSession]:
    await asyncio.to_thread(upgrade_database, sqlite_url)
    engine = create_async_engine(sqlite_url, poolclass=NullPool)
    try:
        async with async_sessionmaker(engine, expire_on_commit=False)() as session:
            yield session
    finally:
        await engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest) -> AsyncSession:
    name = "db_session" if request.param == "postgresql" else "sqlite_session"
    session: AsyncSession = request.getfixturevalue(name)
    return session


async def test_search_finds_the_source_of_a_paraphrase_on_both_databases(store: AsyncSession, settings: Any) -> None:
    noise = [f"{UNRELATED} Note {i} on leaves, stomata and chlorophyll {i}." for i in range(30)]
    ids = await _seed(store, [ORIGINAL, *noise])
    search = ProvenanceSearch(ProvenanceRepository(store), SKETCHER, TracePolicy.from_settings(settings))
    query = search.sketch(PARAPHRASE)
    assert query is not None and search.enabled
    leads = await search.search(query, top=5)
    assert leads and leads[0].generation_id == ids[0]
    assert leads[0].similarity >= settings.provenance_match_similarity
    assert all(lead.similarity < leads[0].similarity for lead in leads[1:])
    repo = ProvenanceRepository(store)
    stats = await repo.term_stats(query.terms)
    assert stats.total >= 31
    # a term of the original only (Gutenberg) and one of every noise text (chlorophyll)
    gutenberg, chlorophyll = SKETCHER.term("gutenberg"), SKETCHER.term("chlorophyll")
    if store.get_bind().dialect.name == "sqlite":  # exact frequencies from the postings
        assert stats.of(gutenberg) == 1
        assert (await repo.term_stats([chlorophyll])).of(chlorophyll) == 30
    own = await repo.candidates([gutenberg], 10, user_id=leads[0].user_id)
    assert [c.generation_id for c in own] == [ids[0]]
    assert await repo.candidates([gutenberg], 10, user_id=leads[0].user_id + 10_000) == []


async def test_a_sketch_logged_with_the_shorter_minhash_still_makes_a_copy_holder(
    store: AsyncSession, settings: Any
) -> None:
    """Rows logged before the signature grew keep LEGACY_MINHASH_SIZE values: an edited copy of
    such a completion is compared on those positions and its user is still the copy holder."""
    ids = await _seed(store, [ORIGINAL, UNRELATED])
    legacy = list(SKETCHER.sketch(ORIGINAL).minhash[:LEGACY_MINHASH_SIZE])  # type: ignore[union-attr]
    await store.execute(update(Generation).where(Generation.id == ids[0]).values(sketch_minhash=legacy))
    await store.flush()
    search = ProvenanceSearch(ProvenanceRepository(store), SKETCHER, TracePolicy.from_settings(settings))
    query = search.sketch(ORIGINAL.replace("Europe", "the continent"))
    assert query is not None and len(query.minhash) == MINHASH_SIZE
    leads = await search.search(query, top=5)
    assert leads[0].generation_id == ids[0]
    expected = minhash_similarity(query.minhash[:LEGACY_MINHASH_SIZE], legacy)
    assert leads[0].shingle_similarity == round(expected, 4) and 0.5 < expected < 1.0
    owner = await store.scalar(select(Generation.user_id).where(Generation.id == ids[0]))
    assert search.retrieved(leads).copy_holder == owner


async def test_purge_drops_old_sketches_and_keeps_the_records(store: AsyncSession, settings: Any) -> None:
    old = datetime.now(UTC) - timedelta(days=400)
    old_ids = await _seed(store, [ORIGINAL], created_at=old)
    new_ids = await _seed(store, [UNRELATED])
    repo = ProvenanceRepository(store)
    purged = 0
    while batch := await repo.purge_before(datetime.now(UTC) - timedelta(days=365)):
        purged += batch
    assert purged >= 1
    rows = {
        g.id: g for g in (await store.scalars(select(Generation).where(Generation.id.in_(old_ids + new_ids)))).all()
    }
    for row in rows.values():
        await store.refresh(row)
    assert rows[old_ids[0]].sketch_terms is None and rows[old_ids[0]].sketch_minhash is None
    assert rows[new_ids[0]].sketch_terms
    assert len(rows) == 2  # the records stay
    search = ProvenanceSearch(ProvenanceRepository(store), SKETCHER, TracePolicy.from_settings(settings))
    assert all(lead.generation_id != old_ids[0] for lead in await search.search(search.sketch(ORIGINAL), top=5))
    if store.get_bind().dialect.name == "sqlite":  # the trigger dropped its postings too
        left = await store.scalar(
            text("SELECT count(*) FROM provenance_postings WHERE generation_id = :g"), {"g": old_ids[0]}
        )
        assert left == 0


async def test_purge_command_respects_the_retention(sqlite_url: str, sqlite_session: AsyncSession) -> None:
    old = datetime.now(UTC) - timedelta(days=40)
    await _seed(sqlite_session, [ORIGINAL], created_at=old)
    await sqlite_session.commit()
    engine = create_async_engine(sqlite_url, poolclass=NullPool)
    try:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        assert await purge_sketches(maker, 0) == 0  # 0 keeps every sketch
        assert await purge_sketches(maker, 60) == 0
        assert await purge_sketches(maker, 30) == 1
        assert await purge_sketches(maker, 30) == 0
    finally:
        await engine.dispose()


def test_a_sketch_that_fails_costs_only_the_sketch() -> None:
    class Broken(Sketcher):
        def sketch(self, text: str, *, limit: int = 0) -> Any:
            raise RuntimeError("boom")

    assert sketch_columns(Broken(b"k" * 32), "some text") == {"sketch_terms": None, "sketch_minhash": None}
    assert sketch_columns(None, "some text") == {"sketch_terms": None, "sketch_minhash": None}
    assert sketch_columns(SKETCHER, "🙂") == {"sketch_terms": None, "sketch_minhash": None}


async def test_a_served_completion_is_logged_with_its_sketch(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any
) -> None:
    assert await app.state.resources.backend.wait_ready(180)
    _, key = await make_user("user")
    body = {
        "model": app.state.resources.backend.model_id,
        "messages": [{"role": "user", "content": "Describe a quiet river in the hills."}],
        "max_tokens": 40,
    }
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
    assert response.status_code == 200, response.text
    data = response.json()
    row = None
    for _ in range(100):  # written as the response ends
        row = (await db_session.scalars(select(Generation).where(Generation.request_id == data["id"]))).first()
        if row is not None:
            break
        await asyncio.sleep(0.05)
    assert row is not None
    sketcher = app.state.resources.sketcher
    expected = sketcher.sketch(data["choices"][0]["message"]["content"])
    assert row.sketch_terms == list(expected.terms)
    assert row.sketch_minhash == list(expected.minhash)
    search = ProvenanceSearch(
        ProvenanceRepository(db_session), sketcher, TracePolicy.from_settings(app.state.resources.settings)
    )
    query = sketcher.sketch(data["choices"][0]["message"]["content"], limit=QUERY_TERM_LIMIT)
    leads = await search.search(query, top=3)
    assert leads[0].request_id == data["id"] and leads[0].similarity == 1.0


async def test_corroboration_needs_the_named_users_completion_to_be_the_closest(settings: Any) -> None:
    """A naming is corroborated by the named user's log only when no other user's logged
    completion is closer to the text; the top matches are listed either way."""
    index = MemoryIndex()
    now = datetime.now(UTC)
    for generation_id, user_id, body in ((1, 10, ORIGINAL), (2, 20, PARAPHRASE), (3, 30, UNRELATED)):
        sketch = SKETCHER.sketch(body)
        assert sketch is not None
        index.add(LoggedSketch(generation_id, user_id, f"req-{generation_id}", now, "m", sketch.terms, sketch.minhash))
    search = ProvenanceSearch(index, SKETCHER, TracePolicy.from_settings(settings))
    query = search.sketch(ORIGINAL)
    leads = await search.search(query, top=5)
    assert [lead.user_id for lead in leads[:2]] == [10, 20]
    own = await search.corroborate(query, leads, 10)
    assert own.status == "corroborated" and own.matches[0].request_id == "req-1"
    closer_elsewhere = await search.corroborate(query, leads, 20)  # user 20 holds a paraphrase, user 10 the text
    assert leads[1].similarity >= settings.provenance_match_similarity
    assert closer_elsewhere.status == "not_found" and closer_elsewhere.note == RIVAL_NOTE
    assert closer_elsewhere.matches[0].user_id == 10
    # a user with no log at all, the text logged as user 10's: the same note, user 10 first
    unlogged = await search.corroborate(query, leads, 40)
    assert unlogged.status == "not_found" and unlogged.note == RIVAL_NOTE and unlogged.matches[0].user_id == 10
    # nothing in the log resembles the text as much as a match must: the plain note
    unrelated = search.sketch("Quarterly tidal almanacs list lunar perigee dates for harbour pilots.")
    far_leads = await search.search(unrelated, top=5)
    assert all(lead.similarity < settings.provenance_match_similarity for lead in far_leads)
    alone = await search.corroborate(unrelated, far_leads, 40)
    assert alone.status == "not_found" and alone.note == NOT_FOUND_NOTE
    nobody = await search.corroborate(query, leads, None)
    assert nobody.status == "leads" and nobody.matches[0].user_id == 10
    assert (await search.corroborate(search.sketch("🙂"), [], 10)).status == "not_found"
