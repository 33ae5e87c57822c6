"""The HTTP edge against slow and hostile clients, on a real server configured as `xmark serve`
configures it (``service.server``), in a process of its own so that its memory can be measured:

* a request without a valid key is refused before its body is read;
* a body that does not arrive within ``body_read_timeout_s`` ends with 408 and the connection closed,
  and the memory of many such connections returns when they close;
* a request head over ``max_header_bytes`` is refused (431), one that trickles is cut off;
* no redirect is built from the Host header; error messages echo no more than an excerpt.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from pydantic import SecretStr

from benchmarks.launch import free_port
from service.config import Settings
from service.security import generate_api_key
from tests.conftest import make_test_settings
from tests.service.conftest import own_database
from tests.service.live_gateway import gateway_process

pytestmark = [pytest.mark.postgres]

BODY_READ_TIMEOUT_S = 2.0
KEEP_ALIVE_TIMEOUT_S = 2.0
MAX_HEADER_BYTES = 16_384
SLOW_CLIENTS = 200
MIB = 1024 * 1024
# a connection cut at BODY_READ_TIMEOUT_S or KEEP_ALIVE_TIMEOUT_S (2 s) ends within this after its
# start: 5x margin, the slowest of 200 slow bodies was cut 2.10 s after it began here and a
# trickling head 2.00 s after
CUT_WITHIN_S = 11.0
# how long a test client waits for a connection that should be cut: beyond CUT_WITHIN_S, so one
# that is never cut fails the bound (or gives no answer) rather than passing at the read's end
NEVER_CUT_S = 40.0


class Server:
    def __init__(self, settings: Settings, admin_key: str, pid: int) -> None:
        self.settings = settings
        self.host = settings.host
        self.port = settings.port
        self.base_url = f"http://{settings.host}:{settings.port}"
        self.admin_key = admin_key
        self.process = psutil.Process(pid)

    def rss(self) -> int:
        return int(self.process.memory_info().rss)


@pytest.fixture(scope="module")
async def edge_database(settings: Settings) -> AsyncIterator[str]:
    async with own_database(settings, "xmark_edge") as url:
        yield url


@pytest.fixture(scope="module")
def server(edge_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    var_dir = tmp_path_factory.mktemp("edge")
    admin_key = generate_api_key().plaintext
    settings = make_test_settings(
        var_dir,
        database_url=edge_database,
        bootstrap_admin_key=SecretStr(admin_key),
        port=free_port(),
        body_read_timeout_s=BODY_READ_TIMEOUT_S,
        keep_alive_timeout_s=KEEP_ALIVE_TIMEOUT_S,
        max_header_bytes=MAX_HEADER_BYTES,
        auth_cache_ttl_s=60.0,
    )
    with gateway_process(settings, var_dir / "server.log") as process:
        yield Server(settings, admin_key, process.pid)


def _head(server: Server, method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {server.host}:{server.port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _read_response(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` passes)."""
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionError):
        pass
    return data


def _status(response: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", response)
    return int(match.group(1)) if match else None


async def test_a_request_without_a_key_is_refused_before_its_body_is_read(server: Server) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        # a large body is announced and never sent: the answer must not wait for it
        writer.write(_head(server, "POST", "/v1/chat/completions", {"Content-Length": "900000"}))
        await writer.drain()
        started = time.monotonic()
        response = await _read_response(reader, timeout=10)
        assert _status(response) == 401, response[:200]
        # 5x margin and more: answered 0.03 s after the head here, where reading the body would
        # wait for the read's timeout (10 s)
        assert time.monotonic() - started < 1.0
        assert b"connection: close" in response.lower()  # the body is not read: the connection ends
    finally:
        writer.close()


async def _slow_client(server: Server) -> tuple[int | None, float]:
    """Announces a body, sends 16 KiB of it at once and then one byte a second."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    head = _head(
        server,
        "POST",
        "/admin/users",
        {"Authorization": f"Bearer {server.admin_key}", "Content-Type": "application/json", "Content-Length": "900000"},
    )
    writer.write(head + b'{"name": "' + b"a" * 16_384)
    await writer.drain()
    started = time.monotonic()
    response = asyncio.ensure_future(_read_response(reader, timeout=NEVER_CUT_S))
    try:
        while not response.done():
            try:
                writer.write(b"a")
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait({response}, timeout=1.0)
        data = await response
        return _status(data), time.monotonic() - started
    finally:
        writer.close()


async def test_slow_bodies_are_cut_at_the_deadline_and_their_memory_returns(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:  # the admin key is cached from here on
        assert (await client.get("/admin/users", headers={"Authorization": f"Bearer {server.admin_key}"})).is_success
    baseline = server.rss()
    peak = baseline
    clients = asyncio.gather(*(_slow_client(server) for _ in range(SLOW_CLIENTS)))
    while not clients.done():
        peak = max(peak, server.rss())
        await asyncio.wait({clients}, timeout=0.2)
    results = clients.result()
    statuses = [status for status, _ in results]
    assert statuses.count(408) == SLOW_CLIENTS, sorted(set(map(str, statuses)))
    # each was cut at the deadline (plus the time to accept and authenticate 200 connections at
    # once): see CUT_WITHIN_S for the margin
    slowest = max(elapsed for _, elapsed in results)
    assert slowest < CUT_WITHIN_S, slowest
    await asyncio.sleep(1.0)
    after = server.rss()
    # nothing of a body is buffered by the gateway beyond what uvicorn reads ahead (64 KiB each)
    assert peak - baseline < 64 * MIB, (baseline, peak)
    assert after - baseline < 32 * MIB, (baseline, after)
    # the server still answers, no connection of the 200 is left open
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        assert (await client.get("/healthz")).status_code == 200
    # no client connection stays established on the gateway's port (the database pool's connections
    # are the process's own and may be several): polled, 10 s at most, not sampled once
    deadline = time.monotonic() + 10.0
    while True:
        connections = [
            c
            for c in server.process.net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == server.port
        ]
        if not connections or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert not connections, connections


async def test_a_head_over_the_limit_is_refused_with_431(server: Server) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(_head(server, "GET", "/healthz", {"X-Padding": "a" * (MAX_HEADER_BYTES + 100)}))
        await writer.drain()
        response = await _read_response(reader, timeout=10)  # 5x margin and more: answered at once
        assert _status(response) == 431, response[:200]
        assert b'"code": "header_too_large"' in response
    finally:
        writer.close()


async def test_a_64_mb_header_is_not_read(server: Server) -> None:
    _reader, writer = await asyncio.open_connection(server.host, server.port)
    baseline = server.rss()
    sent = 0
    try:
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: {server.host}\r\nX-Padding: ".encode())
        chunk = b"a" * 65536
        while sent < 64 * MIB:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except ConnectionError:
        pass
    finally:
        writer.close()
    # refused after max_header_bytes and one read: the server closed long before 64 MB were sent
    assert sent < 8 * MIB
    assert server.rss() - baseline < 16 * MIB


async def test_a_trickling_head_is_cut_at_the_keep_alive_timeout(server: Server) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    started = time.monotonic()
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        closed = asyncio.ensure_future(_read_response(reader, timeout=NEVER_CUT_S))
        while not closed.done():
            try:
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait({closed}, timeout=0.5)
        assert await closed == b""  # closed without an answer
        elapsed = time.monotonic() - started
        assert elapsed < CUT_WITHIN_S, elapsed  # (see CUT_WITHIN_S for the margin)
    finally:
        writer.close()


async def test_no_redirect_is_built_from_the_host_header(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        response = await client.get(
            "/v1/models/", headers={"Host": "attacker.example", "Authorization": f"Bearer {server.admin_key}"}
        )
    assert response.status_code == 404
    assert "location" not in response.headers
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("max_tokens", ["9" * 5000, "1" + "0" * 400, "1e400"])
async def test_error_messages_echo_no_long_values(server: Server, max_tokens: str) -> None:
    body = (
        '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], '
        f'"max_tokens": {max_tokens}}}'
    )
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        response = await client.post(
            "/v1/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {server.admin_key}", "Content-Type": "application/json"},
        )
    assert 400 <= response.status_code < 500, response.text[:300]
    error: dict[str, Any] = response.json()["error"]
    assert len(error["message"]) <= 400
    assert not re.search(r"\d{33,}", response.text)


def test_the_protocol_reads_its_limits_from_the_settings(tmp_path: Path) -> None:
    from service.server import GatewayHttpProtocol, server_options

    options = server_options(make_test_settings(tmp_path, max_connections=7, keep_alive_timeout_s=3.0))
    assert options["http"] is GatewayHttpProtocol
    assert options["limit_concurrency"] == 7 and options["timeout_keep_alive"] == 3.0
    assert options["h11_max_incomplete_event_size"] == 16_384


def test_requests_over_the_connection_cap_get_503_in_the_envelope(edge_database: str, tmp_path: Path) -> None:
    from tests.service.live_gateway import live_gateway

    settings = make_test_settings(tmp_path, database_url=edge_database, port=free_port(), max_connections=3)
    with live_gateway(settings) as base_url:
        held = [socket.create_connection((settings.host, settings.port)) for _ in range(3)]
        try:
            response = httpx.get(f"{base_url}/healthz", timeout=10)  # 5x margin and more: milliseconds
        finally:
            for connection in held:
                connection.close()
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "overloaded"
        assert response.headers["retry-after"] == "1" and response.headers["connection"] == "close"
        time.sleep(0.2)
        assert httpx.get(f"{base_url}/healthz", timeout=10).status_code == 200  # (as above)
