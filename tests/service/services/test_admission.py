"""Admission control: the backend's queue bound, the per-user limits and the per-end-user limits,
counted in this process and in the real Redis (127.0.0.1:6379, keys under a prefix of each test's
own), Redis outages, and what a client sees: 429 with Retry-After, 400 for a prompt over the token limit, 504 at the
deadline, and a backend failure as an error (never a completion that looks finished)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.backends.base import GREEDY_TEMPERATURE, ChatTurn, GenerationRequest
from service.config import Settings
from service.errors import RateLimitError
from service.metrics import Metrics
from service.models import Generation, User
from service.schemas.common import EndUserIdentity, Principal
from service.services import admission as admission_module
from service.services.admission import Admission, redis_client, window_wait_s
from tests.fakes import FakeBackend

REDIS_URL = "redis://127.0.0.1:6379/0"

MakeAdmission = Callable[..., Admission]


def _principal(user_id: int, **limits: int | None) -> Principal:
    return Principal(user_id=user_id, name=f"user-{user_id}", role="user", api_key_id=user_id, **limits)


def _for(caller: Principal, end_user_id: int, **limits: int | None) -> Principal:
    """``caller``'s request for its end user ``end_user_id`` (with that end user's own limits)."""
    end_user = EndUserIdentity(id=end_user_id, identifier=f"platform-user-{end_user_id}", **limits)
    return caller.model_copy(update={"end_user": end_user})


def _limits(settings: Settings, **update: Any) -> Settings:
    values = {
        "user_max_parallel_requests": 0,
        "user_requests_per_minute": 0,
        "user_tokens_per_minute": 0,
        "end_user_requests_per_minute": 0,
        "end_user_tokens_per_minute": 0,
        "max_queued_requests": 1000,
    }
    values.update(update)
    return settings.model_copy(update=values)


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own in the real Redis; its keys are deleted afterwards."""
    prefix = f"xmark-test:{uuid.uuid4().hex}:"
    yield prefix
    client = redis_client(REDIS_URL, 2.0)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture(params=["in-process", "redis"])
async def make_admission(
    request: pytest.FixtureRequest, settings: Settings, redis_prefix: str
) -> AsyncIterator[MakeAdmission]:
    """Admission points counting in this process or in the real Redis (all sharing one prefix:
    two of them are two replicas)."""
    built: list[Admission] = []

    def factory(metrics: Metrics | None = None, **update: Any) -> Admission:
        configured = _limits(settings, **update)
        client = redis_client(REDIS_URL, 1.0) if request.param == "redis" else None
        built.append(Admission(configured, metrics or Metrics(), client, key_prefix=redis_prefix))
        return built[-1]

    yield factory
    for admission in built:
        await admission.close()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port nothing listens on (bound, never listening: connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# -- the sliding window ------------------------------------------------------------------------


def test_window_wait_is_zero_when_the_cost_fits_and_counts_the_sliding_tail() -> None:
    assert window_wait_s(current=0, previous=0, elapsed=0.5, cost=10, limit=10) == 0.0
    # previous window full (10), half of it still inside the last minute: 5 + 0 + 10 > 10
    # until the previous window has slid out completely: at the end of this window, 30 s on
    assert window_wait_s(current=0, previous=10, elapsed=0.5, cost=10, limit=10) == pytest.approx(30.0)
    # current window full: after it rolls over (30 s) it weighs 10 * (1 - g); 1 more fits at g = 0.1
    assert window_wait_s(current=10, previous=0, elapsed=0.5, cost=1, limit=10) == pytest.approx(36.0)
    assert window_wait_s(current=0, previous=0, elapsed=0.0, cost=11, limit=10) == 60.0  # never fits


def test_temperatures_too_small_to_sample_with_are_greedy() -> None:
    turns = (ChatTurn("user", "hi"),)
    assert GenerationRequest(turns, max_tokens=1, temperature=1e-45).greedy
    assert GenerationRequest(turns, max_tokens=1, temperature=0.0).greedy
    assert not GenerationRequest(turns, max_tokens=1, temperature=GREEDY_TEMPERATURE).greedy


# -- limits, in this process and in Redis -----------------------------------------------------


async def test_parallel_requests_are_limited_and_a_release_frees_a_slot(make_admission: MakeAdmission) -> None:
    metrics = Metrics()
    admission = make_admission(metrics, user_max_parallel_requests=2)
    caller = _principal(1)
    first = await admission.admit(caller, 10)
    await admission.admit(caller, 10)
    with pytest.raises(RateLimitError) as refused:
        await admission.admit(caller, 10)
    assert refused.value.param == "max_parallel_requests"
    assert refused.value.code == "rate_limit_exceeded"
    assert "parallel requests" in refused.value.message
    assert refused.value.headers == {"Retry-After": "1"}
    assert await admission.admit(_principal(2), 10)  # another user is not affected
    first.release(5)
    await admission.flush()
    assert await admission.admit(caller, 10)
    assert _sample(metrics, "xmark_admission_refusals_total", limit="max_parallel_requests") == 1


async def test_requests_per_minute_and_the_retry_after(make_admission: MakeAdmission) -> None:
    admission = make_admission(user_requests_per_minute=3)
    caller = _principal(1)
    for _ in range(3):
        (await admission.admit(caller, 1)).release(1)
    with pytest.raises(RateLimitError) as refused:
        await admission.admit(caller, 1)
    assert refused.value.param == "requests_per_minute"
    assert "3 requests per minute" in refused.value.message
    assert refused.value.headers is not None
    assert 1 <= int(refused.value.headers["Retry-After"]) <= 120


async def test_tokens_are_reserved_up_front_and_corrected_to_what_was_used(make_admission: MakeAdmission) -> None:
    admission = make_admission(user_tokens_per_minute=1000)
    caller = _principal(1)
    first = await admission.admit(caller, 600)
    with pytest.raises(RateLimitError) as refused:  # 600 reserved + 600 > 1000
        await admission.admit(caller, 600)
    assert refused.value.param == "tokens_per_minute"
    first.release(100)  # it used 100 of its 600
    await admission.flush()
    await admission.admit(caller, 600)  # 100 + 600 fit
    with pytest.raises(RateLimitError) as alone:
        await admission.admit(_principal(2), 1001)
    assert "more than your limit of 1000 tokens per minute" in alone.value.message


async def test_overrides_none_takes_the_default_and_zero_is_unlimited(make_admission: MakeAdmission) -> None:
    admission = make_admission(user_max_parallel_requests=1)
    await admission.admit(_principal(1, max_parallel_requests=None), 1)
    with pytest.raises(RateLimitError):
        await admission.admit(_principal(1, max_parallel_requests=None), 1)
    for _ in range(5):
        await admission.admit(_principal(2, max_parallel_requests=0), 1)
    await admission.admit(_principal(3, max_parallel_requests=2), 1)
    await admission.admit(_principal(3, max_parallel_requests=2), 1)
    with pytest.raises(RateLimitError):
        await admission.admit(_principal(3, max_parallel_requests=2), 1)


async def test_the_queue_is_bounded_per_process(make_admission: MakeAdmission) -> None:
    metrics = Metrics()
    admission = make_admission(metrics, max_queued_requests=2)
    first = await admission.admit(_principal(1), 1)
    await admission.admit(_principal(2), 1)
    with pytest.raises(RateLimitError) as refused:
        await admission.admit(_principal(3), 1)
    assert refused.value.param == "queue" and refused.value.code == "rate_limit_exceeded"
    assert refused.value.headers == {"Retry-After": "1"}
    first.release(1)
    await admission.admit(_principal(3), 1)
    assert _sample(metrics, "xmark_admission_refusals_total", limit="queue") == 1


async def test_a_refused_request_takes_nothing(make_admission: MakeAdmission) -> None:
    admission = make_admission(user_max_parallel_requests=1, user_requests_per_minute=2, max_queued_requests=5)
    held = await admission.admit(_principal(1), 1)
    for _ in range(3):
        with pytest.raises(RateLimitError):
            await admission.admit(_principal(1), 1)
    assert admission.queued == 1  # the refusals took no queue slot
    held.release(1)
    await admission.flush()
    await admission.admit(_principal(1), 1)  # the second request of the minute: refusals were not counted


# -- an account's end users ---------------------------------------------------------------------


async def test_an_end_user_at_its_request_limit_holds_back_no_other_end_user(make_admission: MakeAdmission) -> None:
    metrics = Metrics()
    admission = make_admission(metrics, end_user_requests_per_minute=2, user_requests_per_minute=5)
    account = _principal(1)
    alice, bob = _for(account, 11), _for(account, 12)
    for _ in range(2):
        (await admission.admit(alice, 1)).release(1)
    with pytest.raises(RateLimitError) as refused:
        await admission.admit(alice, 1)
    error = refused.value
    assert error.code == "end_user_rate_limit_exceeded" and error.param == "end_user_requests_per_minute"
    assert "this end user: 2 requests per minute" in error.message
    assert "platform-user" not in error.message  # never the identifier
    assert error.headers is not None and 1 <= int(error.headers["Retry-After"]) <= 120
    # the account's other end users, and the account itself, go on
    (await admission.admit(bob, 1)).release(1)
    (await admission.admit(account, 1)).release(1)
    # the account's own limit still applies on top: 5 requests this minute, the refusal took none
    (await admission.admit(bob, 1)).release(1)
    with pytest.raises(RateLimitError) as over_account:
        await admission.admit(_for(account, 13), 1)
    assert over_account.value.code == "rate_limit_exceeded" and over_account.value.param == "requests_per_minute"
    # another account's end user of the same id is another end user
    (await admission.admit(_for(_principal(2), 11), 1)).release(1)
    assert _sample(metrics, "xmark_admission_refusals_total", limit="end_user_requests_per_minute") == 1


async def test_an_end_user_token_budget_is_reserved_and_corrected_apart(make_admission: MakeAdmission) -> None:
    admission = make_admission(end_user_tokens_per_minute=1000, user_tokens_per_minute=5000)
    account = _principal(1)
    alice, bob = _for(account, 11), _for(account, 12)
    first = await admission.admit(alice, 600)
    with pytest.raises(RateLimitError) as refused:  # 600 reserved + 600 > 1000
        await admission.admit(alice, 600)
    assert refused.value.code == "end_user_rate_limit_exceeded"
    assert refused.value.param == "end_user_tokens_per_minute"
    assert "1000 tokens per minute (about 600 in use, this request reserves 600)" in refused.value.message
    await admission.admit(bob, 600)  # a sibling's budget is its own
    first.release(100)  # it used 100 of its 600: the end user's window is corrected too
    await admission.flush()
    await admission.admit(alice, 600)
    with pytest.raises(RateLimitError) as alone:
        await admission.admit(_for(account, 13), 1001)
    assert "more than this end user's limit of 1000 tokens per minute" in alone.value.message
    # the account's own budget counts every end user's tokens: 100 + 600 + 600 of 5000 in use
    with pytest.raises(RateLimitError) as over_account:
        await admission.admit(_for(account, 14), 3701)
    assert over_account.value.code == "rate_limit_exceeded" and over_account.value.param == "tokens_per_minute"


async def test_an_end_users_limit_is_its_own_else_the_accounts_else_the_default(
    make_admission: MakeAdmission,
) -> None:
    admission = make_admission(end_user_requests_per_minute=1)
    account = _principal(1, end_user_requests_per_minute=2)
    cases = [
        (_for(_principal(2), 21), 1),  # the setting
        (_for(account, 11), 2),  # the account's override
        (_for(account, 12, requests_per_minute=3), 3),  # the end user's own, above the account's
        (_for(_principal(3, end_user_requests_per_minute=5), 31, requests_per_minute=1), 1),  # and below
    ]
    for caller, allowed in cases:
        for _ in range(allowed):
            (await admission.admit(caller, 1)).release(1)
        with pytest.raises(RateLimitError) as refused:
            await admission.admit(caller, 1)
        assert f"{allowed} requests per minute" in refused.value.message
    for _ in range(5):  # 0 is unlimited, at any level
        await admission.admit(_for(account, 13, requests_per_minute=0), 1)
        await admission.admit(_for(_principal(4, end_user_requests_per_minute=0), 41), 1)


async def test_replicas_share_the_end_user_limits_through_redis(settings: Settings, redis_prefix: str) -> None:
    configured = _limits(settings, end_user_requests_per_minute=2)
    replicas = [Admission(configured, Metrics(), redis_client(REDIS_URL, 1.0), key_prefix=redis_prefix) for _ in "ab"]
    try:
        alice = _for(_principal(7), 70)
        await replicas[0].admit(alice, 1)
        await replicas[1].admit(alice, 1)
        with pytest.raises(RateLimitError) as refused:
            await replicas[0].admit(alice, 1)
        assert refused.value.param == "end_user_requests_per_minute"
        await replicas[1].admit(_for(_principal(7), 71), 1)
    finally:
        for replica in replicas:
            await replica.close()


async def test_replicas_share_the_limits_through_redis(settings: Settings, redis_prefix: str) -> None:
    configured = _limits(settings, user_max_parallel_requests=2, user_requests_per_minute=3)
    replicas = [Admission(configured, Metrics(), redis_client(REDIS_URL, 1.0), key_prefix=redis_prefix) for _ in "ab"]
    try:
        caller = _principal(7)
        a = await replicas[0].admit(caller, 1)
        await replicas[1].admit(caller, 1)
        with pytest.raises(RateLimitError) as refused:
            await replicas[0].admit(caller, 1)
        assert refused.value.param == "max_parallel_requests"
        a.release(1)
        await replicas[0].flush()
        await replicas[1].admit(caller, 1)  # the third request this minute, on the other replica
        with pytest.raises(RateLimitError) as refused:
            await replicas[0].admit(_principal(7, max_parallel_requests=0), 1)
        assert refused.value.param == "requests_per_minute"
    finally:
        for replica in replicas:
            await replica.close()


async def test_a_crashed_replicas_slots_expire(
    settings: Settings, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admission_module, "LEASE_GRACE_S", 0.0)
    configured = _limits(settings, user_max_parallel_requests=1, request_timeout_s=0.3)
    crashed = Admission(configured, Metrics(), redis_client(REDIS_URL, 1.0), key_prefix=redis_prefix)
    survivor = Admission(configured, Metrics(), redis_client(REDIS_URL, 1.0), key_prefix=redis_prefix)
    try:
        await crashed.admit(_principal(9), 1)  # never released
        # within the lease (0.3 s): 5x margin and more, the two admissions took 0.005 s here
        with pytest.raises(RateLimitError):
            await survivor.admit(_principal(9), 1)
        await asyncio.sleep(0.4)
        await survivor.admit(_principal(9), 1)
    finally:
        await crashed.close()
        await survivor.close()


# -- Redis down or hung ------------------------------------------------------------------------


async def test_redis_down_falls_back_to_per_process_limits(settings: Settings, closed_port: int) -> None:
    metrics = Metrics()
    configured = _limits(settings, user_max_parallel_requests=1, redis_timeout_s=0.5)
    admission = Admission(configured, metrics, redis_client(f"redis://127.0.0.1:{closed_port}/0", 0.5))
    try:
        held = await admission.admit(_principal(1), 1)
        with pytest.raises(RateLimitError):  # still limited, by this process's counters
            await admission.admit(_principal(1), 1)
        held.release(1)
        await admission.admit(_principal(1), 1)
    finally:
        await admission.close()
    assert _sample(metrics, "xmark_admission_redis_errors_total") == 1  # then skipped for a while
    assert _sample(metrics, "xmark_admission_redis_fallbacks_total") == 3


async def test_a_hung_redis_costs_at_most_its_timeout(settings: Settings) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    metrics = Metrics()
    configured = _limits(settings, user_requests_per_minute=10, redis_timeout_s=0.2)
    admission = Admission(configured, metrics, redis_client(f"redis://127.0.0.1:{port}/0", 0.2))
    try:
        started = time.perf_counter()
        # the server never answers: without the client's 0.2 s timeout the admission would hang
        # until this test's own limit (30 s) fails it
        await asyncio.wait_for(admission.admit(_principal(1), 1), 30)
        elapsed = time.perf_counter() - started
        # 5x margin: 0.20 s measured here (the timeout itself)
        assert elapsed < 1.5, elapsed
    finally:
        await admission.close()
        server.close()
    assert _sample(metrics, "xmark_admission_redis_fallbacks_total") == 1


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture
def swap(app: Any) -> Iterator[Callable[..., None]]:
    """Replace fields of the app's resources for one test (restored afterwards)."""
    resources = app.state.resources
    saved: dict[str, Any] = {}

    def replace(**fields: Any) -> None:
        for name, value in fields.items():
            saved.setdefault(name, getattr(resources, name))
            setattr(resources, name, value)

    yield replace
    for name, value in saved.items():
        setattr(resources, name, value)


@pytest.fixture
async def fake(app: Any, swap: Callable[..., None]) -> FakeBackend:
    """The fake backend in place of the app's (the model is not the point of these tests)."""
    backend = FakeBackend(app.state.resources.settings.model_name)
    await backend.start()
    swap(backend=backend)
    return backend


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(model: str, **overrides: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 20, **overrides}


async def _rows(session: AsyncSession, user_id: int) -> list[Generation]:
    session.expire_all()
    return list((await session.scalars(select(Generation).where(Generation.user_id == user_id))).all())


async def _sse(response: httpx.Response) -> list[Any]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


UserFactory = Callable[..., Awaitable[tuple[dict[str, Any], str]]]


async def test_a_user_over_their_limit_gets_429_in_the_envelope(
    app: Any,
    client: httpx.AsyncClient,
    make_user: UserFactory,
    db_session: AsyncSession,
    fake: FakeBackend,
    swap: Callable[..., None],
) -> None:
    settings = app.state.resources.settings
    swap(admission=Admission(settings, Metrics()))
    principal, key = await make_user("user")
    await db_session.execute(update(User).where(User.id == principal["user_id"]).values(requests_per_minute=2))
    await db_session.commit()
    statuses = []
    for _ in range(3):
        response = await client.post("/v1/chat/completions", json=_chat(settings.model_name), headers=_bearer(key))
        statuses.append(response.status_code)
    assert statuses == [200, 200, 429]
    assert int(response.headers["Retry-After"]) >= 1
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "rate_limit_error",
            "param": "requests_per_minute",
            "code": "rate_limit_exceeded",
        }
    }
    assert "2 requests per minute" in response.json()["error"]["message"]
    assert len(fake.requests) == 2  # the refused one never reached the backend


async def test_requests_succeed_with_per_process_limits_when_redis_is_down(
    app: Any,
    client: httpx.AsyncClient,
    make_user: UserFactory,
    fake: FakeBackend,
    swap: Callable[..., None],
    closed_port: int,
) -> None:
    resources = app.state.resources
    settings = resources.settings.model_copy(update={"user_max_parallel_requests": 1, "redis_timeout_s": 0.5})
    before = _sample(resources.metrics, "xmark_admission_redis_fallbacks_total")
    admission = Admission(settings, resources.metrics, redis_client(f"redis://127.0.0.1:{closed_port}/0", 0.5))
    swap(admission=admission, settings=settings)
    _, key = await make_user("user")
    try:
        fake.token_delay_s = 0.05  # long enough for the second request to find the first running
        first = asyncio.create_task(
            client.post("/v1/chat/completions", json=_chat(settings.model_name), headers=_bearer(key))
        )
        # until the first request holds its slot (5 s or more: 5x margin and more, it held it
        # 0.01 s after it was sent here); it then runs 12 to 20 tokens of 0.05 s, 0.6 s or more,
        # and the second request is answered within it (5x margin and more: 0.003 s here)
        for _ in range(500):
            if admission.queued:
                break
            await asyncio.sleep(0.01)
        second = await client.post("/v1/chat/completions", json=_chat(settings.model_name), headers=_bearer(key))
        assert (await first).status_code == 200
        assert second.status_code == 429 and second.json()["error"]["param"] == "max_parallel_requests"
        fake.token_delay_s = 0.0
        third = await client.post("/v1/chat/completions", json=_chat(settings.model_name), headers=_bearer(key))
        assert third.status_code == 200
    finally:
        await admission.close()
    assert _sample(resources.metrics, "xmark_admission_redis_fallbacks_total") - before == 3
    metrics_text = (await client.get("/metrics")).text
    assert "xmark_admission_redis_fallbacks_total" in metrics_text


async def test_a_prompt_over_the_token_limit_is_refused_before_the_backend(
    app: Any, client: httpx.AsyncClient, make_user: UserFactory, fake: FakeBackend, swap: Callable[..., None]
) -> None:
    settings = app.state.resources.settings.model_copy(update={"max_prompt_tokens": 20})
    swap(settings=settings)
    _, key = await make_user("user")
    body = _chat(settings.model_name, messages=[{"role": "user", "content": "word " * 30}])
    response = await client.post("/v1/chat/completions", json=body, headers=_bearer(key))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "35 tokens" in error["message"] and "limit is 20" in error["message"]
    assert fake.requests == []


async def test_the_deadline_gives_504_and_records_an_error(
    app: Any,
    client: httpx.AsyncClient,
    make_user: UserFactory,
    db_session: AsyncSession,
    fake: FakeBackend,
    swap: Callable[..., None],
) -> None:
    settings = app.state.resources.settings.model_copy(update={"request_timeout_s": 0.3})
    admission = Admission(settings, Metrics())
    swap(settings=settings, admission=admission)
    # 12 to 40 tokens (the fake's answer) of 0.5 s each: 6 s or more, far past the deadline and
    # the bound below
    fake.token_delay_s = 0.5
    principal, key = await make_user("user")
    body = _chat(settings.model_name, max_tokens=40, messages=[{"role": "user", "content": "x"}])
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body, headers=_bearer(key))
    elapsed = time.perf_counter() - started
    # 5x margin: answered 0.31 s after it was sent here (the 0.3 s deadline); without the deadline,
    # 6 s or more
    assert elapsed < 2.0, elapsed
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_timeout"
    # the stream's tokens too are 0.5 s each (6 s or more): 5x margin and more, its error event
    # came 0.33 s after it was sent here (the deadline); a stream the deadline missed would
    # end with [DONE]
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=_bearer(key)
    ) as sse:
        assert sse.status_code == 200
        events = await _sse(sse)
    assert events[-1]["error"]["code"] == "request_timeout"
    assert "[DONE]" not in events
    rows = await _rows(db_session, principal["user_id"])
    assert sorted(row.finish_reason for row in rows) == ["error", "error"]
    assert admission.queued == 0  # both gave their slot back


async def test_a_backend_failure_is_an_error_and_recorded_as_one(
    app: Any,
    client: httpx.AsyncClient,
    make_user: UserFactory,
    db_session: AsyncSession,
    fake: FakeBackend,
    swap: Callable[..., None],
) -> None:
    settings = app.state.resources.settings
    admission = Admission(settings, Metrics())
    swap(admission=admission)
    fake.fail_after = 3  # the "model" raises after three tokens
    principal, key = await make_user("user")
    body = _chat(settings.model_name, max_tokens=30)
    response = await client.post("/v1/chat/completions", json=body, headers=_bearer(key))
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "backend_error"
    assert response.json()["error"]["type"] == "server_error"
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=_bearer(key)
    ) as sse:
        events = await _sse(sse)
    contents = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e.get("choices")]
    assert [c for c in contents if c]  # the tokens before the failure were sent
    assert events[-1]["error"]["code"] == "backend_error"
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events[:-1])
    rows = await _rows(db_session, principal["user_id"])
    assert sorted(row.finish_reason for row in rows) == ["error", "error"]
    assert all(0 < row.completion_tokens <= 3 for row in rows)
    assert admission.queued == 0
