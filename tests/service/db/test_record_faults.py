"""Exactly-once generation records under database faults, on a PostgreSQL server of the test's
own (benchmarks.pg_server) and a real gateway on a real port (fake backend, tokens paced so that
clients can leave midway): the server is stopped under load, started again, hung (SIGSTOP) and
resumed. Afterwards every completion that was answered 200 (streams the client left included)
has exactly one row per choice, none twice, and no record was dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks import pg_server
from benchmarks.launch import free_port
from service.db import upgrade_database
from service.security import generate_api_key
from tests.conftest import make_test_settings

pytestmark = pytest.mark.skipif(not pg_server.available(), reason="no PostgreSQL binaries to run a private server")

TOKEN_DELAY_S = 0.02
MAX_TOKENS = 12


@pytest.fixture
def pg() -> Iterator[pg_server.PrivatePostgres]:
    with pg_server.private_postgres() as server:
        upgrade_database(server.url)
        yield server


@contextlib.contextmanager
def gateway(var_dir: Path, database_url: str, admin_key: str, **overrides: Any) -> Iterator[tuple[str, Any]]:
    """A gateway in a thread (uvicorn as `xmark serve` runs it); yields its URL and app."""
    import service.resources
    from service.app import create_app
    from service.server import server_options
    from tests.fakes import FakeBackend

    def paced(settings: Any, metrics: Any) -> FakeBackend:
        backend = FakeBackend(settings.model_name)
        backend.token_delay_s = TOKEN_DELAY_S
        return backend

    settings = make_test_settings(
        var_dir,
        database_url=database_url,
        bootstrap_admin_key=SecretStr(admin_key),
        auth_cache_ttl_s=120,  # keys are known while the database is away
        record_spool_drain_interval_s=0.5,
        # the per-user limit of parallel requests (8 by default) is not what this tests, and it is
        # timing: the load's seven clients stay under it only while each stream its client left
        # gives its slot back before that client's next request (on a loaded machine one did not:
        # 30 of 143 requests refused 429 here)
        user_max_parallel_requests=0,
        host="127.0.0.1",
        port=free_port(),
        **overrides,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", paced)
        app = create_app(settings)
        server = uvicorn.Server(uvicorn.Config(app, **server_options(settings, log_level="warning", lifespan="on")))
        thread = threading.Thread(target=server.run, name="fault-gateway", daemon=True)
        thread.start()
        base_url = f"http://127.0.0.1:{settings.port}"
        try:
            # 5x margin and more: the gateway answered 1.8 s or less after its thread started here
            started = time.monotonic()
            deadline = started + 60
            while True:
                assert thread.is_alive(), "the gateway exited during start-up"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{base_url}/healthz", timeout=2.0).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.1)
            print(f"\nthe gateway started in {time.monotonic() - started:.2f} s")
            yield base_url, app
        finally:
            server.should_exit = True
            thread.join(timeout=60)  # 5x margin and more: it stopped in 0.3 s or less here
            assert not thread.is_alive(), "the gateway did not shut down"


class Load:
    """Clients looping until stopped: non-streamed (n=2), streamed, and streams left midway.
    ``answered``: request id -> choices, for every completion answered 200."""

    # (the clients' 60 s: 5x margin and more over any request here, answered within the outage's
    # bounds, database_timeout_s = 1 s, or at once)
    def __init__(self, base_url: str, key: str, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.headers = {"Authorization": f"Bearer {key}"}
        self.answered: dict[str, int] = {}
        self.statuses: dict[int, int] = {}
        self.stop = asyncio.Event()

    def _body(self, i: int, **extra: Any) -> dict[str, Any]:
        content = f"request {i}: name some colours"
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            **extra,
        }

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        kind = i % 3
        if kind == 0:
            response = await client.post("/v1/chat/completions", json=self._body(i, n=2), headers=self.headers)
            self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
            if response.status_code == 200:
                self.answered[response.json()["id"]] = 2
            return
        body = self._body(i, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=self.headers) as response:
            self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"id"' in line:
                    self.answered[line.split('"id":"', 1)[1].split('"', 1)[0]] = 1
                    if kind == 2:
                        return  # the client leaves after the first chunk

    async def _client(self, worker: int) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60) as client:
            i = worker
            while not self.stop.is_set():
                await self._one(client, i)
                i += 7

    async def run(self, workers: int = 7) -> asyncio.Future[Any]:
        return asyncio.gather(*(self._client(w) for w in range(workers)))


async def _records(url: str) -> tuple[dict[str, int], list[Any]]:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            grouped = await connection.execute(text("SELECT request_id, count(*) FROM generations GROUP BY request_id"))
            counts: dict[str, int] = {str(row[0]): int(row[1]) for row in grouped}
            duplicates = (
                await connection.execute(
                    text(
                        "SELECT request_id, choice_index, count(*) FROM generations "
                        "GROUP BY request_id, choice_index HAVING count(*) > 1"
                    )
                )
            ).all()
    finally:
        await engine.dispose()
    return counts, duplicates


async def _settled(url: str, answered: dict[str, int], timeout_s: float = 60) -> tuple[dict[str, int], list[Any]]:
    """The records once every answered completion has its rows (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts, duplicates = await _records(url)
        if all(counts.get(rid, 0) >= n for rid, n in answered.items()) or time.monotonic() > deadline:
            return counts, duplicates
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("record_before_response", [False, True])
async def test_every_answered_completion_has_one_record_after_an_outage_and_a_hang(
    pg: pg_server.PrivatePostgres, tmp_path: Path, record_before_response: bool
) -> None:
    key = generate_api_key().plaintext
    with gateway(tmp_path, pg.url, key, record_before_response=record_before_response) as (base_url, app):
        metrics = app.state.resources.metrics
        model = app.state.resources.backend.model_id
        load = Load(base_url, key, model)
        async with httpx.AsyncClient(base_url=base_url) as client:  # the key is cached from here on
            warm = await client.post("/v1/chat/completions", json=load._body(0), headers=load.headers)
            assert warm.status_code == 200, warm.text
            load.answered[warm.json()["id"]] = 1
        clients = await load.run()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pg.stop)  # a crash: connections reset
        await asyncio.sleep(3.0)
        await asyncio.to_thread(pg.start)
        await asyncio.sleep(1.5)
        await asyncio.to_thread(pg.hang)
        await asyncio.sleep(3.0)
        await asyncio.to_thread(pg.resume)
        await asyncio.sleep(1.0)
        load.stop.set()
        await asyncio.wait_for(clients, 60)  # 5x margin and more: a request ends within 1 s here
        stopped = time.monotonic()
        # (60 s: 5x margin and more, every record had landed 0.55 s or less after the load here)
        counts, duplicates = await _settled(pg.url, load.answered)
        print(f"\n{load.statuses}; records settled {time.monotonic() - stopped:.2f} s after the load")
        spooled = metrics.generation_records_spooled._value.get()
        dropped = metrics.generation_records_dropped._value.get()
    # a count within the 9.5 s of load: 5x margin, 167 to 181 answered here against the 31 needed
    assert load.statuses.get(200, 0) > 30, load.statuses
    assert set(load.statuses) == {200}, load.statuses  # the database's absence costs no completion
    missing = {rid: n for rid, n in load.answered.items() if counts.get(rid, 0) != n}
    assert missing == {} and duplicates == []
    assert spooled > 0  # the outage did reach the records
    assert dropped == 0


async def test_records_spooled_before_a_restart_are_drained_after_it(
    pg: pg_server.PrivatePostgres, tmp_path: Path
) -> None:
    key = generate_api_key().plaintext
    answered: dict[str, int] = {}
    with gateway(tmp_path, pg.url, key) as (base_url, app):
        model = app.state.resources.backend.model_id
        load = Load(base_url, key, model)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            assert (
                await client.post("/v1/chat/completions", json=load._body(0), headers=load.headers)
            ).status_code == 200
            await asyncio.to_thread(pg.stop)
            for i in range(1, 7):
                await load._one(client, i)
        waiting = app.state.resources.metrics.generation_records_waiting._value.get()
        answered = dict(load.answered)
    assert set(load.statuses) == {200} and waiting > 0
    await asyncio.to_thread(pg.start)
    counts, _ = await _records(pg.url)
    assert any(counts.get(rid, 0) == 0 for rid in answered)  # some wait in the spool
    with gateway(tmp_path, pg.url, key):  # the same var dir: the same spool
        # (30 s: 5x margin and more, drained 0.04 s or less after the start here)
        drained = time.monotonic()
        counts, duplicates = await _settled(pg.url, answered, timeout_s=30)
        print(f"\nthe spool drained in {time.monotonic() - drained:.2f} s")
    assert {rid: counts.get(rid, 0) for rid in answered} == answered and duplicates == []
