"""A database that is down or hung: every request that needs it is answered 503
``database_unavailable`` with Retry-After, at once when it is down and within about the gateway's
own bound (database_timeout_s = 1 s) when it hangs (never a 500, never a hang), /readyz says 503 as
fast, the keep-alive connection serves the next request, and the gateway recovers by itself when
the database is back.

The database is a PostgreSQL server of this module's own (``benchmarks.pg_server``), stopped and
frozen (SIGSTOP) here; the gateway is a real uvicorn server on a real port, configured as
`xmark serve` configures it, with the fake backend.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from benchmarks import pg_server
from benchmarks.launch import free_port
from service.db import is_database_fault, upgrade_database
from service.security import generate_api_key
from tests.conftest import make_test_settings
from tests.service.live_gateway import live_gateway

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not pg_server.available(), reason="no PostgreSQL binaries to run a private server"),
]

# a database that is down (stopped: its connections are refused) is answered at once: 5x margin
# and more (200x): 0.01 s measured here for each request and /readyz
DOWN_ANSWER_WITHIN_S = 2.0
# a hung database (SIGSTOP) is answered within the gateway's own bound (database_timeout_s = 1 s),
# where without it the request would hang until the client's timeout (CLIENT_TIMEOUT_S, 4x this):
# 5x margin: measured here 1.02 s for one request, 1.47 s for the slowest of a burst of 40
HUNG_ANSWER_WITHIN_S = 7.5
# the clients' own timeout: the hang a missing database bound would end in (5x margin and more
# over the slowest answer measured here, 1.47 s)
CLIENT_TIMEOUT_S = 30


class Gateway:
    def __init__(self, base_url: str, admin_key: str, pg: pg_server.PrivatePostgres) -> None:
        self.base_url = base_url
        self.admin_key = admin_key
        self.pg = pg


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pg_server.private_postgres() as pg:
        upgrade_database(pg.url)
        admin_key = generate_api_key().plaintext
        settings = make_test_settings(
            tmp_path_factory.mktemp("db-faults"),
            database_url=pg.url,
            bootstrap_admin_key=SecretStr(admin_key),
            port=free_port(),
            auth_cache_ttl_s=60.0,
        )
        with live_gateway(settings) as base_url:
            yield Gateway(base_url, admin_key, pg)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _client_port(response: httpx.Response) -> Any:
    """The client's end of the TCP connection the response came on (same port: same connection)."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


def _new_user_key(gateway: Gateway) -> str:
    """A key the gateway has never seen (its authentication needs the database)."""
    response = httpx.post(
        f"{gateway.base_url}/admin/users",
        json={"name": f"fault-{time.monotonic_ns()}", "role": "user"},
        headers=bearer(gateway.admin_key),
        timeout=10,  # 5x margin and more: a creation takes about 0.05 s here
    )
    assert response.status_code == 201, response.text
    return str(response.json()["api_key"])


def _requests(fresh_key: str, admin_key: str) -> list[tuple[str, str, dict[str, Any] | None, str]]:
    chat = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("POST", "/v1/chat/completions", chat, fresh_key),
        ("GET", "/v1/models", None, fresh_key),
        ("POST", "/trace", {"text": "a text to attribute"}, fresh_key),
        # a cached admin: the route's own database work fails
        ("GET", "/admin/users", None, admin_key),
    ]


def _assert_unavailable(
    client: httpx.Client, method: str, path: str, body: Any, key: str, within_s: float
) -> httpx.Response:
    started = time.perf_counter()
    response = client.request(method, path, json=body, headers=bearer(key))
    elapsed = time.perf_counter() - started
    assert response.status_code == 503, (path, response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == "database_unavailable" and error["type"] == "service_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    assert "SQL" not in error["message"] and "asyncpg" not in error["message"]
    assert elapsed < within_s, (path, elapsed)
    assert response.headers.get("connection", "").lower() != "close"
    return response


def _wait_until_served(client: httpx.Client, key: str, timeout: float = 30.0) -> None:
    # 5x margin and more: the gateway served again 0.05 s after the database came back here
    deadline = time.monotonic() + timeout
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not recover"
        time.sleep(0.2)
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200


def test_database_stopped_gives_503_fast_and_keeps_the_connection(gateway: Gateway) -> None:
    fresh_key = _new_user_key(gateway)
    with httpx.Client(base_url=gateway.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.get("/admin/users", headers=bearer(gateway.admin_key)).status_code == 200  # cached now
        gateway.pg.stop()
        try:
            ports = set()
            for method, path, body, key in _requests(fresh_key, gateway.admin_key):
                ports.add(_client_port(_assert_unavailable(client, method, path, body, key, DOWN_ANSWER_WITHIN_S)))
            started = time.perf_counter()
            ready = client.get("/readyz")
            assert ready.status_code == 503 and time.perf_counter() - started < DOWN_ANSWER_WITHIN_S
            assert ready.json()["error"]["code"] == "database_unavailable"
            ports.add(_client_port(ready))
            assert len(ports) == 1  # one keep-alive connection served every answer
        finally:
            gateway.pg.start()
        # back without restarting the gateway, on the same connection
        _wait_until_served(client, fresh_key)
        assert _client_port(client.get("/healthz")) in ports
        metrics = client.get("/metrics").text
        assert "xmark_database_unavailable_total" in metrics


def test_database_hung_gives_503_fast_and_readyz_says_so(gateway: Gateway) -> None:
    fresh_key = _new_user_key(gateway)
    with httpx.Client(base_url=gateway.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.get("/admin/users", headers=bearer(gateway.admin_key)).status_code == 200
        gateway.pg.hang()
        try:
            ports = set()
            for method, path, body, key in _requests(fresh_key, gateway.admin_key):
                ports.add(_client_port(_assert_unavailable(client, method, path, body, key, HUNG_ANSWER_WITHIN_S)))
            for _ in range(2):  # a probe still waiting on the hung server does not delay the next
                started = time.perf_counter()
                ready = client.get("/readyz")
                # 5x margin: 0.51 s measured here for each probe
                assert ready.status_code == 503 and time.perf_counter() - started < HUNG_ANSWER_WITHIN_S
            assert len(ports) == 1
        finally:
            gateway.pg.resume()
        _wait_until_served(client, fresh_key)
        chat = _requests(fresh_key, gateway.admin_key)[0][2]
        assert client.post("/v1/chat/completions", json=chat, headers=bearer(fresh_key)).status_code == 200


def test_a_burst_while_hung_is_answered_within_the_bound(gateway: Gateway) -> None:
    """More concurrent requests than the pool holds: those waiting for a connection give up too."""
    key = _new_user_key(gateway)

    async def burst() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=CLIENT_TIMEOUT_S) as client:

            async def one() -> tuple[int, float]:
                started = time.perf_counter()
                response = await client.get("/admin/users", headers=bearer(gateway.admin_key))
                return response.status_code, time.perf_counter() - started

            return await asyncio.gather(*(one() for _ in range(40)))

    gateway.pg.hang()
    try:
        results = asyncio.run(burst())
    finally:
        gateway.pg.resume()
    assert {status for status, _ in results} == {503}
    # getting a connection (a wait for the pool, then a connect) and a statement are each bounded
    # by database_timeout_s = 1 s, and a request that waits for the pool gets no connection to use
    # (5x margin: the slowest of the 40 took 1.47 s here; a hang would end at the client's 30 s)
    slowest = max(elapsed for _, elapsed in results)
    assert slowest < HUNG_ANSWER_WITHIN_S, slowest
    with httpx.Client(base_url=gateway.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        _wait_until_served(client, key)


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (PoolTimeoutError("QueuePool limit reached"), True),
        (OperationalError("SELECT 1", None, TimeoutError(), connection_invalidated=True), True),
        (OperationalError("SELECT 1", None, sqlite3.OperationalError("database is locked")), True),
        (OperationalError("SELECT 1", None, sqlite3.OperationalError("no such table: users")), False),
        (IntegrityError("INSERT", None, sqlite3.IntegrityError("UNIQUE constraint failed")), False),
        (ProgrammingError("SELECT", None, Exception("syntax error")), False),
        (ValueError("not a database error"), False),
    ],
)
def test_which_errors_are_database_faults(error: BaseException, fault: bool) -> None:
    assert is_database_fault(error) is fault


def test_a_query_canceled_by_the_server_is_a_fault() -> None:
    import asyncpg
    from sqlalchemy.exc import DBAPIError

    canceled = asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout")
    violation = asyncpg.exceptions.UniqueViolationError("duplicate key")
    assert is_database_fault(DBAPIError("SELECT", None, canceled))  # type: ignore[arg-type]
    assert not is_database_fault(DBAPIError("INSERT", None, violation))  # type: ignore[arg-type]


def test_sqlite_waits_for_a_lock_no_longer_than_the_database_timeout(tmp_path: Path) -> None:
    """The embedded default: a writer blocked by another's lock gives up after database_timeout_s."""
    from sqlalchemy import text

    from service.db import create_engine

    settings = make_test_settings(tmp_path, database_url=f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    settings = settings.model_copy(update={"database_timeout_s": 0.3})

    async def contend() -> tuple[BaseException | None, float]:
        engine = create_engine(settings)
        try:
            async with engine.begin() as connection:
                await connection.execute(text("CREATE TABLE t (x INTEGER)"))
            async with engine.connect() as holder:
                await holder.execute(text("BEGIN IMMEDIATE"))
                await holder.execute(text("INSERT INTO t VALUES (1)"))
                started = time.perf_counter()
                try:
                    async with engine.begin() as writer:
                        await writer.execute(text("INSERT INTO t VALUES (2)"))
                except Exception as exc:
                    return exc, time.perf_counter() - started
                return None, time.perf_counter() - started
        finally:
            await engine.dispose()

    error, elapsed = asyncio.run(contend())
    assert error is not None and is_database_fault(error)
    # 5x margin: the writer gave up after 0.32 s here (its 0.3 s bound); the lock is held until the
    # writer returns, so without the bound it would wait for the driver's default (5 s), past this
    assert elapsed < 3.0, elapsed


def _broken_authentication(app: Any, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    async def authenticate_key(parsed: Any, client: str | None = None) -> Any:
        raise error

    # every route authenticates through authenticate_key (the bearer token or, on the Messages
    # API, x-api-key, read from the headers first)
    monkeypatch.setattr(app.state.resources.authenticator, "authenticate_key", authenticate_key)


async def _get_models(app: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        # a well-formed key (a malformed one is refused before any database read)
        return await client.get("/v1/models", headers={"Authorization": f"Bearer {generate_api_key().plaintext}"})


async def test_a_database_fault_anywhere_in_a_route_is_503(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fault = OperationalError("SELECT secret_column FROM users", {"x": "a row value"}, TimeoutError())
    _broken_authentication(app, monkeypatch, fault)
    response = await _get_models(app)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "database_unavailable"
    assert "secret_column" not in response.text and "a row value" not in response.text
    assert response.headers["retry-after"] == "1" and "connection" not in response.headers


async def test_a_database_error_that_is_a_bug_stays_500(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _broken_authentication(app, monkeypatch, IntegrityError("INSERT", {"name": "a row value"}, Exception("dup")))
    response = await _get_models(app)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error" and "a row value" not in response.text


async def test_an_unexpected_error_says_that_the_connection_closes(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes the connection after an unhandled error: the response must say so, or the
    client's next request on it is reset."""
    _broken_authentication(app, monkeypatch, RuntimeError("a bug"))
    response = await _get_models(app)
    assert response.status_code == 500
    assert response.headers["connection"] == "close"
    assert response.json()["error"]["code"] == "internal_error"


def test_a_cached_key_is_served_while_its_use_cannot_be_recorded(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``last_used_at`` is bookkeeping: when its write is due and the database is gone, the
    request whose key is cached is still answered, and the use noted then is written by the
    background writer once the database is back."""
    import asyncpg

    import service.services.auth

    key = _new_user_key(gateway)
    with httpx.Client(base_url=gateway.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200  # cached now
        monkeypatch.setattr(service.services.auth, "touch_due", lambda *_: True)  # every use is due
        gateway.pg.stop()
        try:
            down_at = datetime.now(UTC)
            started = time.perf_counter()
            answers = [client.get("/v1/models", headers=bearer(key)).status_code for _ in range(3)]
            elapsed = time.perf_counter() - started
            time.sleep(1.5)  # the background writer tries (and fails) at least once meanwhile
        finally:
            gateway.pg.start()
            monkeypatch.undo()  # from here no request notes a use: only the one noted above is pending
        assert answers == [200, 200, 200]
        # 5x margin and more (170x): the three answers took 0.012 s here
        assert elapsed < DOWN_ANSWER_WITHIN_S, elapsed
        _wait_until_served(client, key)

    async def written_since(when: datetime) -> int:
        connection = await asyncpg.connect(gateway.pg.url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return int(await connection.fetchval("SELECT count(*) FROM api_keys WHERE last_used_at >= $1", when))
        finally:
            await connection.close()

    deadline = time.monotonic() + 10  # 5x margin and more: written 0.67 s after the database came back here
    while asyncio.run(written_since(down_at)) == 0:
        assert time.monotonic() < deadline, "the use noted during the outage was never written"
        time.sleep(0.2)
