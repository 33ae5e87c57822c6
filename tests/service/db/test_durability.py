"""What a client is told has happened is committed: checked from a separate connection at the
moment the response starts, against the real app with nothing rolled back. Generation records,
which the client is not told about, are written as the response ends (before it, when
``record_before_response`` is set); a record the database cannot take is spooled and drained
later, and one the spool cannot take either is counted and logged.

These tests do not use the rolled-back ``db_connection``: the app's sessions commit for real, so
every row they create is deleted again at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from starlette.types import Message, Receive, Scope, Send

from service.db import RowWriter, create_sessionmaker, session_scope
from service.db.spool import GENERATION_KEY, RecordSpool, SpooledWriter
from service.errors import DatabaseUnavailableError
from service.models import ApiKey, Generation, MessageId, Trace, User
from service.repositories.unit import Repositories
from service.routers.chat import CompletionResponse
from service.schemas.chat import ChatCompletionRequest
from service.services.users import UserService

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"


@pytest.fixture
async def observer(app: Any) -> AsyncIterator[AsyncEngine]:
    """A connection pool of its own: it sees committed rows only."""
    engine = create_async_engine(app.state.resources.settings.database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
async def committed_users(app: Any) -> AsyncIterator[dict[str, tuple[int, str]]]:
    """A committed user, auditor and admin (role -> (id, API key)); removed with their rows afterwards."""
    assert await app.state.resources.backend.wait_ready(180)
    users: dict[str, tuple[int, str]] = {}
    async with session_scope(app.state.resources.sessionmaker) as session:
        service = UserService(
            Repositories(session), app.state.resources.keyring.params, app.state.resources.api_key_hasher
        )
        for role in ("user", "auditor", "admin"):
            created = await service.create_user(f"durable-{role}", role)  # type: ignore[arg-type]
            users[role] = (created.id, created.api_key)
    try:
        yield users
    finally:
        ids = [user_id for user_id, _ in users.values()]
        async with session_scope(app.state.resources.sessionmaker) as session:
            created_here = select(User.id).where(User.name.like("durable-%"))
            everyone = [*ids, *(await session.scalars(created_here)).all()]
            await session.execute(delete(Generation).where(Generation.user_id.in_(everyone)))
            await session.execute(delete(Trace).where(Trace.requester_id.in_(everyone)))
            await session.execute(delete(ApiKey).where(ApiKey.user_id.in_(everyone)))
            await session.execute(delete(MessageId).where(MessageId.user_id.in_(everyone)))
            await session.execute(delete(User).where(User.id.in_(everyone)))
        app.state.resources.registry_cache.invalidate()


def probing_client(app: Any, probe: Any) -> httpx.AsyncClient:
    """A client whose app runs ``await probe(scope)`` when the response starts, before any byte is sent."""

    async def probed(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_after_probe(message: Message) -> None:
            if message["type"] == "http.response.start":
                await probe(scope, message["status"])
            await send(message)

        await app(scope, receive, send_after_probe)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=probed), base_url="http://testserver")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _count(engine: AsyncEngine, statement: Any) -> int:
    async with engine.connect() as connection:
        return int(await connection.scalar(statement) or 0)


async def _completion_rows_at_response_start(
    app: Any, observer: AsyncEngine, user_id: int, key: str
) -> tuple[list[int], list[int], str]:
    """Three requests of two choices each: committed rows seen when each response starts, and once
    the app has finished with it; the last request id."""
    rows = select(func.count()).select_from(Generation).where(Generation.user_id == user_id)
    seen_at_start: list[int] = []
    seen_after: list[int] = []

    async def probe(scope: Scope, status: int) -> None:
        if scope["path"] == "/v1/chat/completions":
            seen_at_start.append(await _count(observer, rows))

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2}
    async with probing_client(app, probe) as client:
        for _ in range(3):
            # the in-process transport returns once the app is done with the request
            response = await client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert response.status_code == 200, response.text
            assert response.json()["choices"][1]["message"]["content"] is not None
            seen_after.append(await _count(observer, rows))
    return seen_at_start, seen_after, response.json()["id"]


async def test_a_completion_is_sent_first_and_recorded_as_its_response_ends(
    app: Any, observer: AsyncEngine, committed_users: dict[str, tuple[int, str]]
) -> None:
    user_id, key = committed_users["user"]
    assert app.state.resources.settings.record_before_response is False  # the default
    assert app.state.resources.generation_records.direct  # rows go over the writer's own connection
    seen_at_start, seen_after, request_id = await _completion_rows_at_response_start(app, observer, user_id, key)
    assert seen_at_start == [0, 2, 4]  # the response does not wait for its rows
    assert seen_after == [2, 4, 6]  # both choices, committed by the time the request is over
    async with observer.connect() as connection:
        stored = (
            await connection.execute(
                text("SELECT streamed, completion_tokens FROM generations WHERE request_id = :rid"),
                {"rid": request_id},
            )
        ).all()
    assert len(stored) == 2 and not any(row.streamed for row in stored)


async def test_with_record_before_response_a_completion_is_committed_before_its_response_starts(
    app: Any, observer: AsyncEngine, committed_users: dict[str, tuple[int, str]]
) -> None:
    user_id, key = committed_users["user"]
    default = app.state.resources.settings
    app.state.resources.settings = default.model_copy(update={"record_before_response": True})
    try:
        seen_at_start, seen_after, _ = await _completion_rows_at_response_start(app, observer, user_id, key)
    finally:
        app.state.resources.settings = default
    assert seen_at_start == [2, 4, 6]  # both choices of each request, already committed
    assert seen_after == [2, 4, 6]


async def test_a_record_the_database_cannot_take_is_spooled_and_drained_when_it_is_back(
    app: Any, observer: AsyncEngine, committed_users: dict[str, tuple[int, str]], tmp_path: Any
) -> None:
    """The database is really unreachable (a database that does not exist): the client still gets
    its completion, its rows wait in the spool, and a writer on the real database drains them."""
    from service.services import generation

    _user_id, key = committed_users["user"]
    gone = create_async_engine(
        make_url(app.state.resources.settings.database_url).set(database="xmark_no_such_database"), poolclass=NullPool
    )
    principal = await app.state.resources.authenticator.authenticate(f"Bearer {key}")
    metrics = app.state.resources.metrics
    spool_path = tmp_path / "spool.sqlite3"
    records = SpooledWriter(
        RowWriter(create_sessionmaker(gone), Generation.__table__, conflict=GENERATION_KEY),
        RecordSpool(spool_path, Generation.__table__),
        metrics,
    )
    await records.open()
    assert records.direct  # the PostgreSQL path: the writer's own connection cannot be opened
    service = generation.GenerationService(
        records,
        app.state.resources.settings,
        app.state.resources.backend,
        app.state.resources.keyring,
        app.state.resources.metrics,
    )
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2}
    )
    spooled, dropped = metrics.generation_records_spooled, metrics.generation_records_dropped
    before = (spooled._value.get(), dropped._value.get())
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    try:
        response = CompletionResponse.of(await service.complete(service.prepare(principal, body)))
        await response({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, receive, send)
    finally:
        await records.close(5.0)
        await records.writer.close()
        await gone.dispose()
    assert sent[0]["status"] == 200
    request_id = json.loads(sent[1]["body"])["id"]
    assert (spooled._value.get(), dropped._value.get()) == (before[0] + 2, before[1])
    rows = select(func.count()).select_from(Generation).where(Generation.request_id == request_id)
    assert await _count(observer, rows) == 0

    # the database is back: what the gateway's drainer does
    back = SpooledWriter(
        RowWriter(app.state.resources.sessionmaker, Generation.__table__, conflict=GENERATION_KEY),
        RecordSpool(spool_path, Generation.__table__),
        metrics,
    )
    await back.open()
    try:
        assert await back.drain() == 2
    finally:
        await back.close(5.0)
        await back.writer.close()
    assert await _count(observer, rows) == 2


async def test_a_record_neither_the_database_nor_the_spool_takes_is_counted_and_logged(
    app: Any,
    committed_users: dict[str, tuple[int, str]],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Any,
) -> None:
    """Logged without the completion's text, hash or the database's message; with
    ``record_before_response`` the client gets 503 instead of an unrecorded completion."""
    from service.services import generation

    user_id, key = committed_users["user"]
    gone = create_async_engine(
        make_url(app.state.resources.settings.database_url).set(database="xmark_no_such_database"), poolclass=NullPool
    )
    principal = await app.state.resources.authenticator.authenticate(f"Bearer {key}")
    metrics = app.state.resources.metrics
    records = SpooledWriter(
        RowWriter(create_sessionmaker(gone), Generation.__table__, conflict=GENERATION_KEY),
        RecordSpool(tmp_path / "spool.sqlite3", Generation.__table__),
        metrics,
    )
    await records.open()
    await records.spool.close()  # its disk is gone, say
    settings = app.state.resources.settings
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    )
    dropped = metrics.generation_records_dropped
    before = dropped._value.get()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    try:
        service = generation.GenerationService(
            records, settings, app.state.resources.backend, app.state.resources.keyring, metrics
        )
        with caplog.at_level(logging.ERROR, logger="xmark.generation"):
            response = CompletionResponse.of(await service.complete(service.prepare(principal, body)))
            await response({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, receive, send)
        strict = generation.GenerationService(
            records,
            settings.model_copy(update={"record_before_response": True}),
            app.state.resources.backend,
            app.state.resources.keyring,
            metrics,
        )
        with pytest.raises(DatabaseUnavailableError):
            await strict.complete(strict.prepare(principal, body))
    finally:
        await records.writer.close()
        await gone.dispose()
    assert sent[0]["status"] == 200
    completion = json.loads(sent[1]["body"])
    content = completion["choices"][0]["message"]["content"]
    assert dropped._value.get() == before + 2
    [record, _] = [r for r in caplog.records if r.getMessage() == "generation record not written"]
    assert record.request_id == completion["id"] and record.user_id == user_id
    assert record.completion_tokens == [completion["usage"]["completion_tokens"]]
    logged = json.dumps({k: str(v) for k, v in vars(record).items()})
    assert hashlib.sha256(content.encode()).hexdigest() not in logged
    assert "xmark_no_such_database" not in logged  # not the database's own message either
    if content.strip():
        assert content not in logged


async def test_a_stream_is_committed_when_it_ends(
    app: Any, observer: AsyncEngine, committed_users: dict[str, tuple[int, str]]
) -> None:
    _user_id, key = committed_users["user"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key)) as response,
    ):
        assert response.status_code == 200
        raw = (await response.aread()).decode()
    request_id = json.loads(raw.split("\n\n")[0][len("data: ") :])["id"]
    rows = (
        select(func.count())
        .select_from(Generation)
        .where(Generation.request_id == request_id, Generation.streamed.is_(True))
    )
    assert await _count(observer, rows) == 1


async def test_admin_changes_and_traces_are_committed_before_their_response_starts(
    app: Any, observer: AsyncEngine, committed_users: dict[str, tuple[int, str]]
) -> None:
    _, admin_key = committed_users["admin"]
    auditor_id, auditor_key = committed_users["auditor"]
    created = select(func.count()).select_from(User).where(User.name == "durable-created")
    traces = select(func.count()).select_from(Trace).where(Trace.requester_id == auditor_id)
    seen: dict[str, int] = {}

    async def probe(scope: Scope, status: int) -> None:
        if scope["path"] == "/admin/users" and scope["method"] == "POST":
            seen["users"] = await _count(observer, created)
        elif scope["path"] == "/trace":
            seen["traces"] = await _count(observer, traces)

    async with probing_client(app, probe) as client:
        response = await client.post(
            "/admin/users", json={"name": "durable-created", "role": "user"}, headers=bearer(admin_key)
        )
        assert response.status_code == 201, response.text
        assert seen["users"] == 1
        # the new key works on the very next request
        new_key = response.json()["api_key"]
        assert (await client.get("/v1/models", headers=bearer(new_key))).status_code == 200
        traced = await client.post("/trace", json={"text": "Some text to trace here."}, headers=bearer(auditor_key))
        assert traced.status_code == 200, traced.text
        assert seen["traces"] == 1


async def test_a_refused_request_commits_nothing(
    app: Any, observer: AsyncEngine, committed_users: dict[str, tuple[int, str]]
) -> None:
    user_id, key = committed_users["user"]
    rows = select(func.count()).select_from(Generation).where(Generation.user_id == user_id)
    before = await _count(observer, rows)
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        response = await client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 404
    assert await _count(observer, rows) == before
