"""Scale benchmark: the gateway on PostgreSQL holding 10^6 users and 10^7 generation records.

    python -m benchmarks.scale_bench            # make bench-scale: 10^6 users, 10^7 records, 10^6 traces
    python -m benchmarks.scale_bench --users 100000 --records 1000000 --traces 100000   # a quicker run

1. A fresh database (``xmark_scale``, replaced if it exists, dropped at the end unless ``--keep-db``;
   ``--reuse-db`` measures a kept one again) is migrated to head; the gateway's own CLI creates the
   first admin and registers the key version. The bulk is then loaded by PostgreSQL itself
   (``INSERT ... SELECT`` over ``generate_series``, one statement per 10^5–10^6 rows, every index and
   constraint of the schema live): users (every 50th disabled, every 97th deleted), one message ID
   each of the active version's length (a bijection of the row number, so none collide), one API key
   each (random hashes: they fill the index, nobody holds them), generation records spread over 90
   days across all users (two choices per request) and traces. Then ``VACUUM ANALYZE``.
2. ``xmark serve`` (one process, the vLLM backend in front of ``benchmarks.fake_upstream``, as
   deployed) starts on that database: start-up is the time from launch to ``/readyz`` answering 200,
   RSS the process's resident set after start-up and again after the measurements.
3. Measured through HTTP, one request at a time, each kind interleaved with the others:

   * ``auth``: a chat completion of a user whose key this process has not seen yet (200 users,
     created through ``POST /admin/users`` before the gateway restarts, so every key is a cache miss)
     and of one warm key; the gateway's overhead is its latency minus the upstream's own latency
     measured in the same run (direct requests);
   * ``trace``: ``POST /trace`` with ``decoder=counting`` on 150-token texts (the registry's snapshot
     of 10^6 message IDs loaded once, then scored per request);
   * ``admin list`` (``GET /admin/users``, 50 per page, from a random user on: ``after_id``, keyset
     paging; ``admin_list_offset`` the same pages by ``offset``, which reads every row before them), ``admin search``
     (``?q=`` a name fragment) and ``usage`` (``GET /admin/usage?days=30``, and one user's).
4. With the gateway stopped, the latest migration down and up again on that data.

Progress goes to stderr; stdout gets a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil

from benchmarks.bench_gateways import CHECKPOINT, DEFAULT_POSTGRES, MODEL_NAME, _popen, _wait_http
from benchmarks.launch import free_port
from benchmarks.pg_admin import create_database, drop_database
from benchmarks.vllm_overhead import stop_server
from service.db import downgrade_database, upgrade_database

KEY_VERSION = "scale"
DATABASE = "xmark_scale"
USERS_CHUNK = 200_000
RECORDS_CHUNK = 1_000_000
START_TIMEOUT_S = 600.0
GOALS = {
    "startup_s": 60.0,
    "rss_mb": 1536.0,
    "auth_overhead_p50_ms": 3.0,
    "trace_counting_p50_ms": 100.0,
    "admin_list_p50_ms": 50.0,
    "admin_search_p50_ms": 50.0,
    "usage_p50_ms": 200.0,
}
WORDS = [
    "the",
    "river",
    "carried",
    "small",
    "boats",
    "past",
    "the",
    "old",
    "mill",
    "while",
    "children",
    "watched",
    "from",
    "the",
    "bridge",
    "and",
    "their",
    "parents",
    "talked",
    "about",
    "the",
    "harvest",
    "the",
    "weather",
    "and",
    "the",
    "price",
    "of",
    "bread",
    "in",
    "the",
    "market",
    "town",
    "where",
    "every",
    "morning",
    "the",
    "baker",
    "opened",
    "his",
    "shop",
    "before",
    "sunrise",
    "and",
    "the",
    "smell",
    "of",
    "fresh",
    "loaves",
    "filled",
    "the",
    "narrow",
    "streets",
    "that",
    "led",
    "down",
    "to",
    "the",
    "harbour",
    "where",
    "fishermen",
    "mended",
    "their",
    "nets",
]


def _log(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


def _dsn(database_url: str) -> str:
    return database_url.replace("postgresql+asyncpg://", "postgresql://", 1)


def _pct(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": round(statistics.median(ordered), 2), "p99": pick(0.99), "n": len(ordered)}


# -- the load --------------------------------------------------------------------------------------


async def _timed(connection: asyncpg.Connection, what: str, statement: str, *args: Any) -> float:
    started = time.perf_counter()
    await connection.execute(statement, *args)
    elapsed = time.perf_counter() - started
    _log(f"{what}: {elapsed:.1f} s")
    return elapsed


async def load(database_url: str, users: int, records: int, traces: int) -> dict[str, float]:
    connection = await asyncpg.connect(_dsn(database_url))
    timings: dict[str, float] = {}
    try:
        version = await connection.fetchrow("SELECT id, bits, block_bits FROM key_versions WHERE status = 'active'")
        assert version is not None, "no active key version"
        bits = int(version["bits"])
        if bits > 32:
            raise SystemExit(f"the bulk load writes message IDs of at most 32 bits (the active version has {bits})")
        first = int(await connection.fetchval("SELECT coalesce(max(id), 0) FROM users")) + 1
        started = time.perf_counter()
        for start in range(first, first + users, USERS_CHUNK):
            stop = min(first + users, start + USERS_CHUNK) - 1
            # the message ID: the low ``bits`` bits of i * an odd constant, a bijection modulo 2^bits
            await connection.execute(
                """
                INSERT INTO users (id, name, role, status, message_id, created_at, updated_at, deleted_at)
                SELECT i, 'user-' || i, 'user',
                       CASE WHEN i % 97 = 0 THEN 'deleted' WHEN i % 50 = 0 THEN 'disabled' ELSE 'active' END,
                       right(((i * 2654435761) % 4294967296)::bit(32)::text, $3),
                       now() - (i % 700) * interval '1 hour', now() - (i % 300) * interval '1 hour',
                       CASE WHEN i % 97 = 0 THEN now() ELSE NULL END
                FROM generate_series($1::bigint, $2::bigint) AS i
                ON CONFLICT (message_id) DO NOTHING
                """,
                start,
                stop,
                bits,
            )
            _log(f"users up to {stop:,}")
        # a bulk row whose message ID an earlier (random) one already holds was skipped: fill its id with another
        missing = await connection.fetch(
            "SELECT i FROM generate_series(1, (SELECT max(id) FROM users)) AS i WHERE NOT EXISTS "
            "(SELECT 1 FROM users WHERE id = i)"
        )
        for row in missing:
            while True:
                bits_text = format(secrets.randbits(bits), f"0{bits}b")
                inserted = await connection.execute(
                    "INSERT INTO users (id, name, role, status, message_id, created_at, updated_at) "
                    "VALUES ($1, 'user-' || $1, 'user', 'active', $2, now(), now()) "
                    "ON CONFLICT (message_id) DO NOTHING",
                    row["i"],
                    bits_text,
                )
                if inserted.endswith(" 1"):
                    break
        _log(f"{len(missing)} users given another message ID")
        await connection.execute("SELECT setval('users_id_seq', (SELECT max(id) FROM users))")
        timings["users_s"] = time.perf_counter() - started
        timings["message_ids_s"] = await _timed(
            connection,
            "message IDs",
            """
            INSERT INTO message_ids (user_id, bits, block_bits, message_id, created_at)
            SELECT u.id, $1, $2, u.message_id, u.created_at FROM users u
            WHERE u.id >= $3 AND NOT EXISTS (SELECT 1 FROM message_ids m WHERE m.user_id = u.id)
            """,
            bits,
            int(version["block_bits"]),
            first,
        )
        timings["api_keys_s"] = await _timed(
            connection,
            "API keys",
            """
            INSERT INTO api_keys (user_id, prefix, key_hash, created_at)
            SELECT u.id, 'xm_' || substr(md5(u.id::text || 'p'), 1, 8), md5(u.id::text) || md5(u.id::text || 'h'),
                   u.created_at
            FROM users u WHERE u.id >= $1
            """,
            first,
        )
        user_count = int(await connection.fetchval("SELECT count(*) FROM users"))
        started = time.perf_counter()
        for start in range(0, records, RECORDS_CHUNK):
            stop = min(records, start + RECORDS_CHUNK) - 1
            # two choices per request: row i is choice i % 2 of request i / 2
            await connection.execute(
                """
                INSERT INTO generations (request_id, choice_index, user_id, key_version_id, model, prompt_tokens,
                                         completion_tokens, finish_reason, streamed, completion_sha256, created_at)
                SELECT 'chatcmpl-' || (i / 2), i % 2, 1 + (hashint % $3), $4, 'smollm2', 20 + hashint % 400,
                       1 + hashint % 300, 'stop', i % 5 = 0, md5(i::text) || md5((i + 1)::text),
                       now() - ((hashint % 7776000) * interval '1 second')
                FROM (SELECT i, abs(hashtextextended(i::text, 7)) AS hashint
                      FROM generate_series($1::bigint, $2::bigint) AS i) s
                """,
                start,
                stop,
                user_count,
                int(version["id"]),
            )
            _log(f"generation records up to {stop + 1:,}")
        timings["generations_s"] = time.perf_counter() - started
        timings["traces_s"] = await _timed(
            connection,
            "traces",
            """
            INSERT INTO traces (requester_id, created_at, verdict, p_value, statistic, scored_tokens,
                                key_version_id, attributed_user_id, decoder, report_id)
            SELECT 1, now() - (i % 7776000) * interval '1 second',
                   CASE WHEN i % 3 = 0 THEN 'watermarked' ELSE 'not_watermarked' END, 0.5, 1.0, 150, $2,
                   CASE WHEN i % 3 = 0 THEN 1 + i % $3 ELSE NULL END, 'counting', substr('tr_' || md5(i::text), 1, 32)
            FROM generate_series(1, $1::bigint) AS i
            """,
            traces,
            int(version["id"]),
            user_count,
        )
        started = time.perf_counter()
        for table in ("users", "message_ids", "api_keys", "generations", "traces"):
            await connection.execute(f"VACUUM ANALYZE {table}")
        timings["vacuum_analyze_s"] = time.perf_counter() - started
        _log(f"VACUUM ANALYZE: {timings['vacuum_analyze_s']:.1f} s")
    finally:
        await connection.close()
    return {k: round(v, 1) for k, v in timings.items()}


async def counts(database_url: str) -> dict[str, int]:
    connection = await asyncpg.connect(_dsn(database_url))
    try:
        return {
            table: int(await connection.fetchval(f"SELECT count(*) FROM {table}"))
            for table in ("users", "message_ids", "api_keys", "generations", "traces")
        }
    finally:
        await connection.close()


# -- the gateway -----------------------------------------------------------------------------------


class Gateway:
    def __init__(self, database_url: str, upstream_url: str, workdir: Path, secret: str, pepper: str) -> None:
        self.env = {
            **os.environ,
            "XMARK_DATABASE_URL": database_url,
            "XMARK_VAR_DIR": str(workdir / "xmark-var"),
            "XMARK_WATERMARK_SECRETS": f"{KEY_VERSION}:{secret}",
            "XMARK_API_KEY_PEPPER": pepper,
            "XMARK_BACKEND": "vllm",
            "XMARK_VLLM_URLS": upstream_url,
            "XMARK_MODEL_PATH": str(CHECKPOINT),
            "XMARK_MODEL_NAME": MODEL_NAME,
            "XMARK_USER_REQUESTS_PER_MINUTE": "100000",
        }
        self.env.pop("XMARK_SECRETS_FILE", None)
        self.log = workdir / "gateway.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def cli(self, *args: str) -> Any:
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", *args, "--json"], env=self.env, capture_output=True, check=True
        )
        return json.loads(done.stdout)

    async def start(self) -> float:
        self.port = free_port()
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        started = time.perf_counter()
        self.process = _popen(command, self.env, self.log)
        await _wait_http(f"http://127.0.0.1:{self.port}/readyz", self.process, self.log, START_TIMEOUT_S)
        return time.perf_counter() - started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        assert self.process is not None
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        if self.process is not None:
            stop_server(self.process)
            self.process = None


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


async def _time(
    client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str] | None = None, body: Any = None
) -> float:
    started = time.perf_counter()
    response = await client.request(method, url, headers=headers, json=body)
    elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{method} {response.request.url.path}: {response.status_code} {response.text[:300]}")
    return elapsed


async def measure(
    gateway: Gateway, upstream_url: str, admin_key: str, user_keys: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(7)
    admin = {"Authorization": f"Bearer {admin_key}"}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "direct",
            "chat_cold_key",
            "chat_warm_key",
            "trace_counting",
            "admin_list",
            "admin_list_offset",
            "admin_search",
            "usage",
            "usage_one_user",
        )
    }
    async with httpx.AsyncClient(timeout=120.0) as client:
        # the first trace loads the registry's snapshot: timed apart
        trace_url = f"{gateway.url}/trace"
        first_trace = await _time(client, "POST", trace_url, admin, {"text": _text(rng, 110), "decoder": "counting"})
        warm = {"Authorization": f"Bearer {user_keys[0]}"}
        chat_url, direct_url = f"{gateway.url}/v1/chat/completions", f"{upstream_url}/v1/chat/completions"
        for _ in range(5):  # warm-up: connections, the warm key's cache entry
            await client.post(chat_url, json=chat, headers=warm)
            await client.post(direct_url, json=chat)
        max_user = args.users
        for i, key in enumerate(user_keys[1:]):
            offset = rng.randrange(0, max(1, max_user - 50))
            needle = f"user-{rng.randrange(1, max_user)}"[: rng.choice((7, 8, 9))]
            users_url = f"{gateway.url}/admin/users?limit=50"
            steps: list[tuple[str, str, str, dict[str, str] | None, Any]] = [
                ("direct", "POST", direct_url, None, chat),
                ("chat_cold_key", "POST", chat_url, {"Authorization": f"Bearer {key}"}, chat),
                ("chat_warm_key", "POST", chat_url, warm, chat),
                ("admin_list", "GET", f"{users_url}&after_id={offset}", admin, None),
                ("admin_list_offset", "GET", f"{users_url}&offset={offset}", admin, None),
                ("admin_search", "GET", f"{users_url}&q={needle}", admin, None),
            ]
            if i % 2 == 0:
                steps.append(
                    ("trace_counting", "POST", trace_url, admin, {"text": _text(rng, 110), "decoder": "counting"})
                )
            if i % 4 == 0:
                usage_url = f"{gateway.url}/admin/usage?days=30"
                steps.append(("usage", "GET", f"{usage_url}&limit=50", admin, None))
                steps.append(
                    ("usage_one_user", "GET", f"{usage_url}&user_id={rng.randrange(1, max_user)}", admin, None)
                )
            rng.shuffle(steps)
            for name, method, url, headers, body in steps:
                samples[name].append(await _time(client, method, url, headers, body))
    result = {name: _pct(values) for name, values in samples.items() if values}
    result["trace_first_ms"] = round(first_trace, 1)
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    database_url = f"{os.environ.get('XMARK_BENCH_POSTGRES', DEFAULT_POSTGRES)}/{DATABASE}"
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as folder:
        workdir = Path(folder)
        upstream_port = free_port()
        upstream_log = workdir / "upstream.log"
        upstream = _popen(
            [sys.executable, "-m", "benchmarks.fake_upstream", "--port", str(upstream_port), "--tokens", "16"],
            dict(os.environ),
            upstream_log,
        )
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        load_timings: dict[str, float] = {}
        gateway: Gateway | None = None
        try:
            await _wait_http(f"{upstream_url}/health", upstream, upstream_log)
            if args.reuse_db:
                kept = json.loads(await asyncio.to_thread(Path(args.state).read_text))
                secret, pepper, admin_key = kept["secret"], kept["pepper"], kept["admin_key"]
            else:
                secret, pepper = secrets.token_hex(32), secrets.token_hex(32)
                await create_database(database_url, replace=True)
                await asyncio.to_thread(upgrade_database, database_url)
            gateway = Gateway(database_url, upstream_url, workdir, secret, pepper)
            if not args.reuse_db:
                admin_key = (await asyncio.to_thread(gateway.cli, "create-user", "scale-admin", "--role", "admin"))[
                    "api_key"
                ]
            # a first start registers the key version; the measured users are created through the API (each key
            # a cache miss after the restart below), then the bulk is loaded with the gateway stopped
            await gateway.start()
            async with httpx.AsyncClient(timeout=60.0) as client:
                created_ms: list[float] = []
                user_keys = []
                for i in range(args.samples + 1):
                    started = time.perf_counter()
                    response = await client.post(
                        f"{gateway.url}/admin/users",
                        json={"name": f"measured-{secrets.token_hex(3)}-{i}"},
                        headers={"Authorization": f"Bearer {admin_key}"},
                    )
                    created_ms.append((time.perf_counter() - started) * 1000)
                    response.raise_for_status()
                    user_keys.append(response.json()["api_key"])
            gateway.stop()
            if not args.reuse_db:
                load_timings = await load(database_url, args.users, args.records, args.traces)
                state = json.dumps({"secret": secret, "pepper": pepper, "admin_key": admin_key})
                await asyncio.to_thread(Path(args.state).write_text, state)
            rows = await counts(database_url)
            _log(f"rows: {rows}")
            gateway.stop()
            startup_s = await gateway.start()
            rss_start = gateway.rss_mb()
            _log(f"start-up {startup_s:.1f} s, RSS {rss_start:.0f} MiB")
            measured = await measure(gateway, upstream_url, admin_key, user_keys, args)
            rss_end = gateway.rss_mb()
            gateway.stop()
            started = time.perf_counter()
            await asyncio.to_thread(downgrade_database, database_url, "-1")
            down_s = time.perf_counter() - started
            started = time.perf_counter()
            await asyncio.to_thread(upgrade_database, database_url)
            up_s = time.perf_counter() - started
            _log(f"latest migration down {down_s:.1f} s, up {up_s:.1f} s")
        finally:
            if gateway is not None:
                gateway.stop()
            stop_server(upstream)
            if not args.keep_db:
                with contextlib.suppress(Exception):
                    await drop_database(database_url)
    direct_p50 = measured["direct"]["p50"]
    summary = {
        "users": rows["users"],
        "message_ids": rows["message_ids"],
        "generation_records": rows["generations"],
        "traces": rows["traces"],
        "startup_s": round(startup_s, 1),
        "rss_mb": round(max(rss_start, rss_end), 0),
        "rss_after_start_mb": round(rss_start, 0),
        "auth_overhead_p50_ms": round(measured["chat_cold_key"]["p50"] - direct_p50, 2),
        "auth_overhead_p99_ms": round(measured["chat_cold_key"]["p99"] - measured["direct"]["p99"], 2),
        "warm_key_overhead_p50_ms": round(measured["chat_warm_key"]["p50"] - direct_p50, 2),
        "trace_counting_p50_ms": measured["trace_counting"]["p50"],
        "trace_counting_p99_ms": measured["trace_counting"]["p99"],
        "trace_first_ms": measured["trace_first_ms"],
        "admin_list_p50_ms": measured["admin_list"]["p50"],
        "admin_list_offset_p50_ms": measured["admin_list_offset"]["p50"],
        "admin_search_p50_ms": measured["admin_search"]["p50"],
        "usage_p50_ms": measured["usage"]["p50"],
        "usage_one_user_p50_ms": measured["usage_one_user"]["p50"],
        "create_user_p50_ms": round(statistics.median(created_ms), 2),
        "migration_down_s": round(down_s, 2),
        "migration_up_s": round(up_s, 2),
    }
    goals = {
        name: {"goal": goal, "measured": summary[name], "met": summary[name] <= goal} for name, goal in GOALS.items()
    }
    return {
        **summary,
        "samples": measured,
        "goals": goals,
        "load_s": load_timings,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"Scale: {result['users']:,} users, {result['message_ids']:,} message IDs, "
        f"{result['generation_records']:,} generation records, {result['traces']:,} traces (PostgreSQL)",
        f"{'measure':<28}{'p50 ms':>10}{'p99 ms':>10}{'n':>6}",
    ]
    for name, values in result["samples"].items():
        if isinstance(values, dict):
            lines.append(f"{name:<28}{values['p50']:>10.2f}{values['p99']:>10.2f}{values['n']:>6}")
    lines.append(
        f"start-up {result['startup_s']} s, RSS {result['rss_mb']} MiB, first trace {result['trace_first_ms']} ms"
    )
    lines.append(f"latest migration: down {result['migration_down_s']} s, up {result['migration_up_s']} s")
    for name, goal in result["goals"].items():
        lines.append(
            f"goal {name:<24} ≤ {goal['goal']:<8} measured {goal['measured']:<10} {'met' if goal['met'] else 'NOT MET'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--traces", type=int, default=1_000_000)
    parser.add_argument(
        "--samples", type=int, default=200, help="requests of each kind (trace: half, usage: a quarter)"
    )
    parser.add_argument("--keep-db", action="store_true", help=f"keep the database {DATABASE} for --reuse-db")
    parser.add_argument("--reuse-db", action="store_true", help="measure a database kept by --keep-db again")
    parser.add_argument("--state", default=str(Path("var") / "bench-scale-state.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(_table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
