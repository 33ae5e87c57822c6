"""`xmark serve --workers 2` as production runs it, on a PostgreSQL database of its own: the start-up
writes happen once, a user created through one worker is served by the other, /metrics reports the
sum over both workers whichever answers, and the whole server stops cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.launch import free_port
from service.config import Settings
from service.security import generate_api_key
from tests.conftest import TEST_API_KEY_PEPPER, TEST_WATERMARK_SECRETS, checkpoint_path
from tests.service.conftest import own_database

pytestmark = [pytest.mark.model, pytest.mark.postgres]

MODEL = "smollm2-135m-instruct"
WORKERS = 2


@pytest.fixture
async def database(settings: Settings) -> AsyncIterator[str]:
    """A database created, migrated and dropped here (the server's rows are committed for real)."""
    async with own_database(settings, "xmark_workers") as url:
        yield url


def _log_lines(log: Path) -> list[dict[str, Any]]:
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


async def _wait_for(log: Path, message: str, count: int, server: subprocess.Popen[bytes], timeout: float = 240) -> None:
    # 240 s: 5x margin and more, the two workers had loaded the model 24.5 s after the start here
    # (and frozen their heap 0.5 s later)
    deadline = time.monotonic() + timeout
    while sum(1 for line in _log_lines(log) if line["message"] == message) < count:
        # the log is a small local file, read here only once the server has died
        assert server.poll() is None, log.read_text()[-3000:]  # noqa: ASYNC240
        assert time.monotonic() < deadline, f"no {count} x {message!r} in time"
        await asyncio.sleep(0.25)


async def _served_by(log: Path, request_id: str) -> int:
    """The worker that logged the request (its access line is written as the response ends)."""
    for _ in range(100):  # 2 s or more: 5x margin and more, the line was there 0.02 s after the response here
        lines = [line for line in _log_lines(log) if line.get("request_id") == request_id]
        if lines:
            [line] = lines
            return int(line["pid"])
        await asyncio.sleep(0.02)
    raise AssertionError(f"request {request_id} was not logged")


async def _get(base: str, path: str, key: str | None = None) -> httpx.Response:
    """One request on a connection of its own, so that any worker may accept it."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # (the clients' 60 s here: 5x margin and more, a request of this test takes well under 1 s)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await client.get(path, headers=headers)


def _listening_inodes(pid: int, port: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds that listen on ``port`` (from /proc)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    listening.add(int(fields[9]))
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                held.add(int(target[8:-1]))
    return listening & held


def _models_served(exposition: str) -> float:
    prefix = 'xmark_http_requests_total{method="GET",route="/v1/models",status="200"} '
    return sum(float(line[len(prefix) :]) for line in exposition.splitlines() if line.startswith(prefix))


async def _count(engine: AsyncEngine, sql: str) -> int:
    async with engine.connect() as connection:
        return int(await connection.scalar(text(sql)) or 0)


async def test_workers_share_the_port_the_database_and_the_metrics(database: str, tmp_path: Path) -> None:
    admin_key = generate_api_key().plaintext
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {name: value for name, value in os.environ.items() if not name.startswith(("XMARK_", "PROMETHEUS_"))}
    env.update(
        {
            "XMARK_DATABASE_URL": database,
            "XMARK_VAR_DIR": str(tmp_path / "var"),
            "XMARK_WATERMARK_SECRETS": ",".join(f"{k}:{v}" for k, v in TEST_WATERMARK_SECRETS.items()),
            "XMARK_API_KEY_PEPPER": TEST_API_KEY_PEPPER,
            "XMARK_MODEL_PATH": str(checkpoint_path()),
            "XMARK_BOOTSTRAP_ADMIN_KEY": admin_key,
            "XMARK_TRACE_WARM_ROW_TOKENS": "0",
            "XMARK_LOG_LEVEL": "INFO",
            "XMARK_WORKERS": str(WORKERS),
            "TMPDIR": str(temp),  # where the server keeps the workers' metrics
        }
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        # the server outlives this call: it is started once, asked to stop with a signal and waited
        # for at the end, as production runs it (Popen returns once the process is started)
        server = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=out,
        )
    observer = create_async_engine(database, poolclass=NullPool)
    try:
        await _wait_for(log, "local model loaded", WORKERS, server)
        started = {line["pid"] for line in _log_lines(log) if line["message"] == "gateway started"}
        assert len(started) == WORKERS and server.pid not in started
        assert len(list(temp.glob("xmark-metrics-*"))) == 1
        # each worker moves its start-up heap out of the collector's reach once its start-up is done
        await _wait_for(log, "start-up heap frozen", WORKERS, server)
        frozen = [line for line in _log_lines(log) if line["message"] == "start-up heap frozen"]
        assert {line["pid"] for line in frozen} == started and all(line["objects"] > 10_000 for line in frozen)
        # the start-up writes were made once, by the parent, before the workers started
        assert await _count(observer, "SELECT count(*) FROM users WHERE role = 'admin'") == 1
        assert await _count(observer, "SELECT count(*) FROM key_versions") == len(TEST_WATERMARK_SECRETS)
        assert admin_key not in log.read_text()

        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            created = await client.post(
                "/admin/users", json={"name": "alice", "role": "user"}, headers={"Authorization": f"Bearer {admin_key}"}
            )
        assert created.status_code == 201, created.text
        alice = created.json()["api_key"]

        # alice, created through one worker, is served by every worker
        served_models: set[int] = set()
        models_requests = 0
        while len(served_models) < WORKERS:
            assert models_requests < 200, "the workers did not share the connections"
            response = await _get(base, "/v1/models", alice)
            models_requests += 1
            assert response.status_code == 200, response.text
            served_models.add(await _served_by(log, response.headers["x-request-id"]))
        assert served_models == started

        # each worker listens on a socket of its own (SO_REUSEPORT), the supervisor on none: the
        # kernel spreads connections over the workers, where with one shared socket a busy worker
        # took every new connection
        listening = {pid: _listening_inodes(pid, port) for pid in {server.pid, *started}}
        assert listening[server.pid] == set()
        assert all(len(listening[pid]) == 1 for pid in started)
        assert len(set().union(*(listening[pid] for pid in started))) == WORKERS
        # 32 keep-alive connections opened at once: both workers take some (the kernel spreads them
        # by a hash of each connection's addresses: all on one worker by chance, a false failure,
        # with probability 2 in 2**32, under 1e-9)
        clients = [httpx.AsyncClient(base_url=base, timeout=60) for _ in range(32)]
        try:
            answers = await asyncio.gather(
                *(c.get("/v1/models", headers={"Authorization": f"Bearer {alice}"}) for c in clients)
            )
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        models_requests += len(answers)
        assert {a.status_code for a in answers} == {200}
        assert {await _served_by(log, a.headers["x-request-id"]) for a in answers} == started

        # /metrics is the sum over the workers, whichever worker answers it
        answered: set[int] = set()
        for _ in range(200):
            response = await _get(base, "/metrics")
            assert response.status_code == 200
            assert _models_served(response.text) == models_requests
            answered.add(await _served_by(log, response.headers["x-request-id"]))
            if answered == started:
                break
        assert answered == started

        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            completion = await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                headers={"Authorization": f"Bearer {alice}"},
            )
        assert completion.status_code == 200, completion.text
        request_id = completion.json()["id"]
        for _ in range(40):  # committed as the response ends (2 s or more: 5x margin and more, 0.09 s here)
            if await _count(observer, f"SELECT count(*) FROM generations WHERE request_id = '{request_id}'"):
                break
            await asyncio.sleep(0.05)
        assert await _count(observer, f"SELECT count(*) FROM generations WHERE request_id = '{request_id}'") == 1
    finally:
        await observer.dispose()
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)  # 5x margin and more: it stopped 1.3 s after the signal here
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    assert not list(temp.glob("xmark-metrics-*"))  # the metrics folder went with the server
