"""Sharing the model: users take turns in the local backend's batches, a client that leaves stops
its generation (non-streamed ones included) so the next user is served, and a generation that
fails is reported as a failure. With the real model and a real HTTP server where it matters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select

from benchmarks.launch import free_port
from service.backends.base import BackendError, ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.batch import FairBacklog, Job
from service.backends.local import LocalBackend
from service.models import Generation
from service.repositories.unit import Repositories
from service.vocabulary import FinishReason
from xmark_core import Message

UserFactory = Callable[..., Awaitable[tuple[dict[str, Any], str]]]

LONG_TASK = "Write an extremely long and detailed essay, thousands of words, about the history of rivers."


# -- the batcher's order (no model) --------------------------------------------------------------


def _job(user: int | None, rows: int = 1, temperature: float = 0.0) -> Job:
    request = GenerationRequest((ChatTurn("user", "hi"),), max_tokens=4, n=rows, temperature=temperature, user_id=user)
    stamp: Any = SimpleNamespace(key=SimpleNamespace(fingerprint="k"))
    return Job(request, stamp, [1, 2, 3], lambda event: None)


def test_a_users_queue_of_jobs_cannot_hold_back_another_users_job() -> None:
    backlog = FairBacklog()
    hog = [_job(1) for _ in range(10)]
    for job in hog:
        backlog.add(job)
    late = _job(2)
    backlog.add(late)
    first = backlog.next_batch(max_rows=4)
    assert first == [hog[0], late, hog[1], hog[2]]  # FIFO would have been hog[0:4]
    assert backlog.next_batch(max_rows=4) == hog[3:7]
    assert len(backlog) == 3


def test_users_take_turns_starting_the_batch() -> None:
    backlog = FairBacklog()
    a = [_job(1) for _ in range(3)]
    b = [_job(2) for _ in range(2)]
    for job in [*a, *b]:
        backlog.add(job)
    order = [backlog.next_batch(max_rows=1)[0] for _ in range(5)]
    assert order == [a[0], b[0], a[1], b[1], a[2]]
    assert backlog.next_batch(max_rows=1) == []


def test_incompatible_jobs_wait_for_a_batch_of_their_own() -> None:
    backlog = FairBacklog()
    greedy, sampled, anonymous = _job(1), _job(2, temperature=0.8), _job(None, rows=2)
    for job in (greedy, sampled, anonymous):
        backlog.add(job)
    assert backlog.next_batch(max_rows=8) == [greedy, anonymous]
    assert backlog.next_batch(max_rows=8) == [sampled]


# -- with the model --------------------------------------------------------------------------------


@pytest.fixture
async def backend(app: Any) -> LocalBackend:
    backend = app.state.resources.backend
    assert await backend.wait_ready(180), "the local model did not load"
    assert isinstance(backend, LocalBackend)
    return backend


def _stamp(app: Any) -> WatermarkStamp:
    active = app.state.resources.keyring.active()
    key = active.key
    return WatermarkStamp(key, Message.from_bits("01" * (key.params.bits // 2), key.params), active.name)


@pytest.mark.model
async def test_a_late_users_job_runs_in_the_next_batch(app: Any, backend: LocalBackend) -> None:
    """User 1 fills the queue with more jobs than a batch holds; user 2's job, queued last, runs in
    the very next batch and is done before any of them (first come, first served: after all)."""
    stamp = _stamp(app)
    task = (ChatTurn("user", LONG_TASK),)
    finished: dict[str, float] = {}

    async def run(name: str, request: GenerationRequest) -> None:
        await backend.generate(request, stamp)
        finished[name] = time.perf_counter()

    blocker = asyncio.create_task(run("blocker", GenerationRequest(task, max_tokens=64, temperature=0, user_id=1)))
    await asyncio.sleep(0.2)  # the worker takes the blocker; the rest queue up behind it
    hogs = [
        asyncio.create_task(run(f"hog-{i}", GenerationRequest(task, max_tokens=48, temperature=0, user_id=1)))
        for i in range(backend._max_batch_rows + 2)
    ]
    await asyncio.sleep(0.1)
    late = asyncio.create_task(run("late", GenerationRequest(task, max_tokens=3, temperature=0, user_id=2)))
    await asyncio.gather(blocker, late, *hogs)
    assert finished["late"] < min(at for name, at in finished.items() if name.startswith("hog-"))


@pytest.mark.model
async def test_a_failing_generation_is_an_error_not_a_finished_choice(
    app: Any, backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xmark_core.hf

    class Failing(xmark_core.hf.XMarkLogitsProcessor):
        calls = 0

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            Failing.calls += 1
            if Failing.calls > 3:
                raise RuntimeError("probability tensor contains inf or nan")
            return super().__call__(input_ids, scores)

    monkeypatch.setattr(xmark_core.hf, "XMarkLogitsProcessor", Failing)
    request = GenerationRequest((ChatTurn("user", LONG_TASK),), max_tokens=50, temperature=0.8, n=2)
    stream = await backend.stream(request, _stamp(app))
    deltas = []
    with pytest.raises(BackendError) as failed:
        async for delta in stream:
            deltas.append(delta)
    assert failed.value.status_code == 500 and failed.value.code == "backend_error"
    assert not any(d.finish_reason for d in deltas)  # nothing looked finished
    monkeypatch.undo()
    result = await backend.generate(replace(request, max_tokens=3), _stamp(app))  # the worker lives on
    assert all(choice.finish_reason in {FinishReason.STOP, FinishReason.LENGTH} for choice in result.choices)


@pytest.mark.model
async def test_a_temperature_too_small_to_sample_with_decodes_greedily(
    app: Any, backend: LocalBackend, client: httpx.AsyncClient, make_user: UserFactory
) -> None:
    _, key = await make_user("user")
    body = {
        "model": app.state.resources.settings.model_name,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 6,
    }
    headers = {"Authorization": f"Bearer {key}"}
    greedy = await client.post("/v1/chat/completions", json={**body, "temperature": 0}, headers=headers)
    tiny = await client.post("/v1/chat/completions", json={**body, "temperature": 1e-45}, headers=headers)
    assert greedy.status_code == tiny.status_code == 200
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    assert tiny.json()["choices"][0]["message"]["content"]


@pytest.fixture
async def committed_user(app: Any) -> AsyncIterator[Callable[[str], Awaitable[tuple[int, str]]]]:
    """Users committed to the test database (concurrent requests cannot share one test
    transaction's connection); they and their rows are deleted again afterwards."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    from service.db import session_scope
    from service.services.users import UserService

    resources = app.state.resources
    created_ids: list[int] = []

    async def create(name: str) -> tuple[int, str]:
        async with session_scope(resources.sessionmaker) as session:
            created = await UserService(
                Repositories(session), resources.keyring.params, resources.api_key_hasher
            ).create_user(f"{name}-{time.time_ns()}", "user")
        created_ids.append(created.id)
        return created.id, created.api_key

    yield create
    if not created_ids:
        return
    # a completion is answered before its row is written (group commit): a row may still arrive
    # while the users are deleted, so the deletion is retried until no row refers to them
    for attempt in range(50):
        try:
            async with session_scope(resources.sessionmaker) as session:
                for table in ("generations", "api_keys", "message_ids", "users"):
                    column = "id" if table == "users" else "user_id"
                    await session.execute(
                        text(f"DELETE FROM {table} WHERE {column} = ANY(:ids)"),  # fixed names
                        {"ids": created_ids},
                    )
            return
        except IntegrityError:
            if attempt == 49:
                raise
            await asyncio.sleep(0.2)


@pytest.fixture
async def live_url(app: Any) -> AsyncIterator[str]:
    """The test app behind a real uvicorn server on a free port, in the test's event loop, on the
    app's own engine (committed, as in production: no test transaction)."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


@pytest.mark.model
async def test_abandoned_requests_stop_generating_and_the_next_user_is_served(
    app: Any, backend: LocalBackend, live_url: str, committed_user: Callable[[str], Awaitable[tuple[int, str]]]
) -> None:
    """Three non-streamed requests with long prompts whose clients hang up after 1 s: they are
    cancelled (recorded so), and another user's short request is answered within a bound instead
    of waiting for 3 x 1000 tokens."""
    model = app.state.resources.settings.model_name
    hog_id, hog_key = await committed_user("hog")
    other_id, other_key = await committed_user("other")
    prompt = LONG_TASK + " Notes: " + " ".join(f"river {i} flows to the sea;" for i in range(150))
    hog_body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1000, "temperature": 0}

    async def abandoned() -> None:
        # (the clients' 600 s: 5x margin and more over any request here, which takes seconds)
        async with httpx.AsyncClient(base_url=live_url, timeout=600) as http:
            await http.post("/v1/chat/completions", json=hog_body, headers={"Authorization": f"Bearer {hog_key}"})

    hogs = [asyncio.create_task(abandoned()) for _ in range(3)]
    await asyncio.sleep(1.0)
    for task in hogs:
        task.cancel()  # the client hangs up: its connection closes
    await asyncio.gather(*hogs, return_exceptions=True)

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=live_url, timeout=600) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {other_key}"},
        )
    waited = time.perf_counter() - started
    assert response.status_code == 200
    print(f"\nshort request after 3 abandoned long ones: {waited:.1f} s")
    # 5x margin and more: 2.0 s and 3.3 s measured here (a loaded 2-core machine), where the three
    # hogs left to run would first generate their 3 x 1000 tokens
    assert waited < 30.0

    rows: list[Generation] = []
    for _ in range(100):  # written as the cancelled requests end (10 s: 5x margin and more, 0.02 s here)
        async with app.state.resources.sessionmaker() as session:
            rows = list((await session.scalars(select(Generation).where(Generation.user_id == hog_id))).all())
        if len(rows) == 3:
            break
        await asyncio.sleep(0.1)
    assert [row.finish_reason for row in rows] == ["cancelled"] * 3
    assert all(row.completion_tokens < 1000 and not row.streamed for row in rows)
    assert app.state.resources.admission.queued == 0
    # the answered request is recorded too (after its response: group commit); 10 s: 5x margin and
    # more, 0.11 s here
    for _ in range(100):
        async with app.state.resources.sessionmaker() as session:
            answered = list((await session.scalars(select(Generation).where(Generation.user_id == other_id))).all())
        if answered:
            break
        await asyncio.sleep(0.1)
    assert len(answered) == 1 and answered[0].completion_tokens <= 4
