"""``make soak``: a gateway under mixed load through one database outage and one database hang.

A PostgreSQL server of its own (benchmarks.pg_server) and a gateway process served as
``xmark serve`` serves it (the local model by default; ``--fake-backend`` for a quick run). Users
send chat completions (non-streamed with n=2, and streamed) and Anthropic messages
(``POST /v1/messages``, non-streamed and streamed), some clients leaving a stream midway; meanwhile
the database is stopped for ``--outage-s`` and started again, then frozen (SIGSTOP) for
``--hang-s`` and resumed. When the load has ended and the spool has drained, every completion
answered 200 must have exactly one row per choice: a chat completion's rows under its
``chatcmpl-...`` id, a message's one row under its ``msg_...`` id (a stream's from its first
event on, the ``message_start`` for a message). Prints one JSON object: requests,
status_counts, p50_ms / p99_ms (to the response head), records_missing and records_duplicated
(targets 0 and 0), the same per route (``routes``: chat and messages), and the gateway's spooled /
drained / dropped counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.launch import MODEL_NAME, free_port
from benchmarks.pg_server import private_postgres
from service.db import upgrade_database
from service.security import generate_api_key

REPO_ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import sys
import uvicorn
import service.resources
from service.app import create_app, configure_process_logging
from service.config import Settings
from service.server import server_options

if sys.argv[1] == "fake":
    from tests.fakes import FakeBackend

    def paced(settings, metrics):
        backend = FakeBackend(settings.model_name)
        backend.token_delay_s = 0.02
        return backend

    service.resources.build_backend = paced
settings = Settings()
configure_process_logging(settings)
uvicorn.run(create_app(settings), **server_options(settings, log_level="warning"))
"""


@contextlib.contextmanager
def gateway_process(env: dict[str, str], fake: bool, log: Path, base_url: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, "fake" if fake else "model"], cwd=REPO_ROOT, env=env, stderr=sink
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited during start-up (see {log})")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base_url}/readyz", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready")
            time.sleep(0.5)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# The client mix, by request number mod 8: chat non-streamed with n=2, streamed (twice), streamed and
# left after the first text; the same for /v1/messages (one choice: the route has no n).
KINDS = (
    ("chat", "plain"),
    ("chat", "stream"),
    ("chat", "stream"),
    ("chat", "leave"),
    ("messages", "plain"),
    ("messages", "stream"),
    ("messages", "stream"),
    ("messages", "leave"),
)
ROUTES = ("chat", "messages")
ANTHROPIC_VERSION = "2023-06-01"


def stream_id(route: str, line: str) -> str | None:
    """The completion's id in one line of its stream: any chat chunk's ``id``; a message's from its
    ``message_start`` event (the first), ``message.id``."""
    if not line.startswith("data: {"):
        return None
    if route == "chat":
        return line.split('"id":"', 1)[1].split('"', 1)[0] if '"id":"' in line else None
    event = json.loads(line[6:])
    return str(event["message"]["id"]) if event.get("type") == "message_start" else None


def first_text(route: str, line: str) -> bool:
    """Whether the line carries answer text (a chat delta's content, a message's text_delta)."""
    if route == "chat":
        return '"content":"' in line and '"role"' not in line
    return '"text_delta"' in line


class Load:
    def __init__(self, base_url: str, keys: list[str], max_tokens: int) -> None:
        self.base_url, self.keys, self.max_tokens = base_url, keys, max_tokens
        self.answered: dict[str, int] = {}  # id -> rows it must have (one per choice)
        self.route_of: dict[str, str] = {}
        self.statuses: dict[str, int] = {}
        self.route_statuses: dict[str, dict[str, int]] = {route: {} for route in ROUTES}
        self.latencies_ms: list[float] = []
        self.stop = asyncio.Event()

    def _count(self, route: str, status: int | str) -> None:
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        per_route = self.route_statuses[route]
        per_route[str(status)] = per_route.get(str(status), 0) + 1

    def _answered(self, route: str, request_id: str, rows: int) -> None:
        self.answered.setdefault(request_id, rows)
        self.route_of[request_id] = route

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        key = self.keys[i % len(self.keys)]
        route, mode = KINDS[i % len(KINDS)]
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
            "max_tokens": self.max_tokens,
        }
        if route == "chat":
            path, headers, choices = "/v1/chat/completions", {"Authorization": f"Bearer {key}"}, 2
            plain = {**body, "n": choices}
        else:  # keyed as Anthropic's clients key it
            path, headers, choices = "/v1/messages", {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}, 1
            plain = body
        started = time.perf_counter()
        try:
            if mode == "plain":
                response = await client.post(path, json=plain, headers=headers)
                self.latencies_ms.append((time.perf_counter() - started) * 1000)
                self._count(route, response.status_code)
                if response.status_code == 200:
                    self._answered(route, response.json()["id"], choices)
                return
            async with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as response:
                self.latencies_ms.append((time.perf_counter() - started) * 1000)
                self._count(route, response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    return
                async for line in response.aiter_lines():
                    request_id = stream_id(route, line)
                    if request_id is not None:
                        self._answered(route, request_id, 1)
                    if mode == "leave" and first_text(route, line):
                        return  # the client leaves after the first text
        except httpx.HTTPError as exc:
            self._count(route, type(exc).__name__)

    async def user(self, worker: int) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as client:
            i = worker
            while not self.stop.is_set():
                await self.one(client, i)
                i += 97


async def records(url: str) -> tuple[dict[str, int], set[str]]:
    """Rows per request id, and the request ids with a choice recorded more than once."""
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            grouped = await connection.execute(text("SELECT request_id, count(*) FROM generations GROUP BY request_id"))
            counts = {str(row[0]): int(row[1]) for row in grouped}
            duplicated = await connection.execute(
                text(
                    "SELECT DISTINCT request_id FROM generations GROUP BY request_id, choice_index HAVING count(*) > 1"
                )
            )
            twice = {str(row[0]) for row in duplicated}
    finally:
        await engine.dispose()
    return counts, twice


def counter(metrics: str, name: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics, re.M):
        total += float(match.group(1))
    return total


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="xmark-soak-"))
    with private_postgres() as pg:
        await asyncio.to_thread(upgrade_database, pg.url)
        admin_key = generate_api_key().plaintext
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("XMARK_")}
        env.update(
            {
                "PYTHONPATH": str(REPO_ROOT),
                "XMARK_DATABASE_URL": pg.url,
                "XMARK_VAR_DIR": str(work / "var"),
                "XMARK_MODEL_PATH": str(REPO_ROOT / "var" / "models" / MODEL_NAME),
                "XMARK_WATERMARK_SECRETS": "v1:soak-watermark-secret-2f9d61c0b4a7e835",
                "XMARK_API_KEY_PEPPER": "soak-api-key-pepper-71e0c4a9d2b6f358",
                "XMARK_BOOTSTRAP_ADMIN_KEY": admin_key,
                "XMARK_PORT": str(port),
                "XMARK_AUTH_CACHE_TTL_S": "120",
                "XMARK_RECORD_BEFORE_RESPONSE": str(args.record_before_response).lower(),
                "XMARK_LOG_LEVEL": "WARNING",
            }
        )
        with gateway_process(env, args.fake_backend, work / "gateway.log", base_url):
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                keys = [admin_key]
                for u in range(args.users - 1):
                    created = await client.post(
                        "/admin/users",
                        json={"name": f"soak-{u}", "role": "user"},
                        headers={"Authorization": f"Bearer {admin_key}"},
                    )
                    created.raise_for_status()
                    keys.append(created.json()["api_key"])
                load = Load(base_url, keys, args.max_tokens)
                for i, _ in enumerate(keys):  # every key authenticated (cached) before the faults
                    await load.one(client, i * len(KINDS) + 1)
            started = time.monotonic()
            users = asyncio.gather(*(load.user(w) for w in range(args.clients)))
            await asyncio.sleep(args.phase_s)
            await asyncio.to_thread(pg.stop)
            await asyncio.sleep(args.outage_s)
            await asyncio.to_thread(pg.start)
            await asyncio.sleep(args.phase_s)
            await asyncio.to_thread(pg.hang)
            await asyncio.sleep(args.hang_s)
            await asyncio.to_thread(pg.resume)
            await asyncio.sleep(args.phase_s)
            load.stop.set()
            await users
            load_s = time.monotonic() - started
            deadline = time.monotonic() + 120
            while True:  # the spool drains every record_spool_drain_interval_s
                counts, duplicated = await records(pg.url)
                short = [rid for rid, n in load.answered.items() if counts.get(rid, 0) < n]
                if not short or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            missing = len(short)
            # a choice recorded twice, or a completion with more rows than it has choices
            duplicated |= {rid for rid, n in load.answered.items() if counts.get(rid, 0) > n}
            metrics = (await asyncio.to_thread(httpx.get, f"{base_url}/metrics", timeout=10)).text
    latencies = sorted(load.latencies_ms)
    return {
        "backend": "fake" if args.fake_backend else "local",
        "record_before_response": args.record_before_response,
        "users": args.users,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "load_s": round(load_s, 1),
        "outage_s": args.outage_s,
        "hang_s": args.hang_s,
        "requests": sum(load.statuses.values()),
        "status_counts": load.statuses,
        "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1) if latencies else None,
        "completions_answered": len(load.answered),
        "records_missing": missing,
        "records_duplicated": len(duplicated),
        "routes": {
            route: {
                "status_counts": load.route_statuses[route],
                "completions_answered": sum(1 for r in load.route_of.values() if r == route),
                "records_missing": sum(1 for rid in short if load.route_of[rid] == route),
                "records_duplicated": sum(1 for rid in duplicated if load.route_of.get(rid) == route),
            }
            for route in ROUTES
        },
        "records_spooled": counter(metrics, "xmark_generation_records_spooled_total"),
        "records_drained": counter(metrics, "xmark_generation_records_drained_total"),
        "records_dropped": counter(metrics, "xmark_generation_records_dropped_total"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--fake-backend", action="store_true", help="serve the fake backend instead of the model")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, spread over the users")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--phase-s", type=float, default=15.0, help="load before, between and after the faults")
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--hang-s", type=float, default=10.0)
    parser.add_argument("--record-before-response", action="store_true")
    print(json.dumps(asyncio.run(soak(parser.parse_args()))))


if __name__ == "__main__":
    main()
