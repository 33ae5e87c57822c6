"""End users: what an end user's first request costs, first sights racing, a flood of invented identifiers.

    python -m benchmarks.end_users_bench --out docs/results/bench_end_users.json   # make bench-end-users
    python -m benchmarks.end_users_bench --first 200 --race-requests 2000 --race-identifiers 200 --flood-s 5

A fresh PostgreSQL database (``xmark_end_users_bench`` on ``XMARK_BENCH_POSTGRES``, default
127.0.0.1:5432; replaced if it exists, dropped at the end) is migrated to head; ``xmark serve`` (one
process, the vLLM backend in front of ``benchmarks.fake_upstream``: scale_bench's gateway) runs on it
and the accounts are created through ``POST /admin/users``. The per-user and per-end-user request
limits are off (``XMARK_USER_*=0``, ``XMARK_END_USER_*=0``) and the admission bounds above the load,
so only the end-user path and its caps decide; the database bound (``--database-timeout-s``) and the
end-user cache's TTL are the product's. Every request is a chat completion naming its end user in
``safety_identifier``.

1. **first vs known** (``--first N``): one account sends N requests that each name a new identifier
   (first sight: the account's end-user lock, the caps' counts, one message ID per length in use, the
   audit entry), interleaved, in shuffled rounds, with requests naming one of its known (cached) end
   users and with requests straight to the upstream; one request at a time. Gateway time is latency
   minus the upstream's own latency (the same percentile, same run); the first sights' p50 minus the
   known ones' comes with a percentile-bootstrap 95 % interval, and the first sights' gateway p50 per
   quarter of the phase shows how it grows with the registry.
2. **race** (``--race-requests``, ``--race-identifiers``): another account's requests, each
   identifier's repeats adjacent, are all created at once and sent over ``--race-connections``
   connections (httpx's pool of that size behind a semaphore of that size); in flight = sent and not
   yet answered, beside the peak of the gateway's PostgreSQL sessions running a statement and of
   those waiting for a lock (pg_stat_activity, sampled). Then PostgreSQL itself counts that account's
   end users, their message IDs (exactly one per length in use each) and the audit trail's creations,
   and the gateway's access log its answers to that account: a request the client lost to a read
   error on a kept-alive connection the gateway closed (its idle bound, ``keep_alive_timeout_s``,
   passed while the loaded client had not yet sent it) is one the gateway never read, told apart
   from an error it answered. The clients close connections idle ``CLIENT_KEEPALIVE_S``; the
   gateway runs with ``keep_alive_timeout_s`` at ``RACE_KEEP_ALIVE_S``, since a client of 1,000
   connections on the gateway's own two cores lags seconds behind its answers (at the default 5 s,
   57 of 10^4 requests were lost so, none read by the gateway).
   The new-per-minute cap is off in phases 1–2.
3. **flood** (``--flood-s``): the gateway restarts with ``XMARK_END_USERS_MAX_PER_ACCOUNT`` at
   ``--flood-cap`` (new per minute: the product's default). Accounts O1..Ok (``--others``) each send requests naming
   one of their known end users, one at a time, ``--pause-ms`` apart, for S seconds alone and then S
   seconds while account F sends a new identifier per request from ``--flood-connections``
   connections (in a process of its own, so the flood's client does not delay the measuring one). The
   O accounts' p50, flooded over unflooded, with a bootstrap interval; F's status counts (its 200s must
   equal the cap, the rest 429 ``end_user_limit_exceeded``) and its end users in PostgreSQL.

Progress goes to stderr; each phase prints its figures; stdout ends with one JSON object.
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
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import numpy as np
from sqlalchemy.engine import make_url

from benchmarks.bench_gateways import DEFAULT_POSTGRES, MODEL_NAME, _popen, _wait_http
from benchmarks.launch import free_port
from benchmarks.pg_admin import create_database, drop_database
from benchmarks.scale_bench import Gateway
from benchmarks.vllm_overhead import stop_server
from service.db import upgrade_database
from service.security import generate_api_key

DATABASE = "xmark_end_users_bench"
KEY_VERSION = "bench"
KNOWN_PER_ACCOUNT = 10
REQUEST_TIMEOUT_S = 120.0
ADMIN_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 900.0  # a whole phase (or the flood process) past it is a failure, not a wait
# the clients close a connection idle this long, well before the gateway's keep_alive_timeout_s (5 s):
# at an equal bound (httpx's default) a client loaded like these ones can send a request on a
# connection just as the gateway closes it (a read error no server can prevent)
CLIENT_KEEPALIVE_S = 2.0
RACE_KEEP_ALIVE_S = 60.0  # the gateway's keep_alive_timeout_s here (see ``run``)
FLOOD_LEAD_S = 1.0  # the flood process and the measuring loops start together this long after the order
LIMIT_CODE = "end_user_limit_exceeded"
GOALS = {
    "first_minus_known_p50_ms": 1.0,  # at most
    "flood_p50_ratio": 1.10,  # at most
}


def _log(message: str) -> None:
    print(f"[end-users] {message}", file=sys.stderr, flush=True)


def _dsn(database_url: str) -> str:
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def _pick(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _pct(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p95": round(_pick(ordered, 0.95), 3),
        "p99": round(_pick(ordered, 0.99), 3),
        "n": len(ordered),
    }


def _medians_ci95(
    a: Sequence[float], b: Sequence[float], combine: Callable[[Any, Any], Any], resamples: int = 5000
) -> list[float]:
    """Percentile-bootstrap 95 % interval of combine(median(a), median(b)), each sample resampled alone (seeded)."""
    rng = np.random.default_rng(0)
    x, y = np.asarray(a), np.asarray(b)
    mx = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    my = np.median(y[rng.integers(0, y.size, size=(resamples, y.size))], axis=1)
    return [round(float(q), 3) for q in np.percentile(combine(mx, my), [2.5, 97.5])]


def _chat(identifier: str) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "safety_identifier": identifier,
    }


def _status(response: httpx.Response) -> str:
    """The status, with the error's code for a refusal (``429 end_user_limit_exceeded``)."""
    if response.status_code < 400:
        return str(response.status_code)
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return f"{response.status_code} {response.json()['error']['code']}"
    return str(response.status_code)


async def _post(client: httpx.AsyncClient, url: str, body: Any, headers: dict[str, str]) -> float:
    """One request that must answer 200; its latency in ms."""
    started = time.perf_counter()
    response = await client.post(url, json=body, headers=headers)
    elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"POST {response.request.url.path}: {response.status_code} {response.text[:300]}")
    return elapsed


async def _accounts(base_url: str, admin_key: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Accounts (role user) created through the admin API: name -> {id, api_key, lengths}."""
    created: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=ADMIN_TIMEOUT_S) as client:
        for name in names:
            response = await client.post(
                f"{base_url}/admin/users",
                json={"name": f"{name}-{secrets.token_hex(3)}"},
                headers={"Authorization": f"Bearer {admin_key}"},
            )
            response.raise_for_status()
            body = response.json()
            lengths = sorted({(m["bits"], m["block_bits"]) for m in body["message_ids"]})
            created[name] = {"id": body["id"], "api_key": body["api_key"], "lengths": lengths}
    return created


async def _warm(base_url: str, key: str, identifiers: Sequence[str]) -> None:
    """Each identifier's end user created (or read) and cached, the connection open."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(2):
            for identifier in identifiers:
                await _post(client, f"{base_url}/v1/chat/completions", _chat(identifier), headers)


# -- 1. first vs known -----------------------------------------------------------------------------


async def first_vs_known(base_url: str, upstream_url: str, key: str, n: int) -> dict[str, Any]:
    rng = random.Random(11)
    known = [f"known-{i}" for i in range(KNOWN_PER_ACCOUNT)]
    await _warm(base_url, key, known)
    headers = {"Authorization": f"Bearer {key}"}
    chat_url, direct_url = f"{base_url}/v1/chat/completions", f"{upstream_url}/v1/chat/completions"
    samples: dict[str, list[float]] = {"direct": [], "first": [], "known": []}
    run = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(5):  # warm-up: both connections
            await _post(client, direct_url, _chat("warm-up"), {})
            await _post(client, chat_url, _chat(known[0]), headers)
        for i in range(n):
            steps: list[tuple[str, str, dict[str, Any], dict[str, str]]] = [
                ("direct", direct_url, _chat("direct"), {}),
                ("first", chat_url, _chat(f"first-{run}-{i}"), headers),
                ("known", chat_url, _chat(known[i % len(known)]), headers),
            ]
            rng.shuffle(steps)
            for name, url, body, step_headers in steps:
                samples[name].append(await _post(client, url, body, step_headers))
    stats = {name: _pct(values) for name, values in samples.items()}
    direct = stats["direct"]
    gateway = {
        name: {"p50": round(stats[name]["p50"] - direct["p50"], 3), "p95": round(stats[name]["p95"] - direct["p95"], 3)}
        for name in ("first", "known")
    }
    quarter = max(1, n // 4)
    by_quarter = [
        round(statistics.median(samples["first"][i : i + quarter]) - direct["p50"], 3)
        for i in range(0, quarter * 4, quarter)
        if samples["first"][i : i + quarter]
    ]
    return {
        "requests_each": n,
        "latency_ms": stats,
        "gateway_ms": gateway,
        "first_minus_known_p50_ms": round(stats["first"]["p50"] - stats["known"]["p50"], 3),
        "first_minus_known_p50_ci95": _medians_ci95(samples["first"], samples["known"], np.subtract),
        "first_minus_known_p95_ms": round(stats["first"]["p95"] - stats["known"]["p95"], 3),
        "first_gateway_p50_by_quarter_ms": by_quarter,
    }


# -- 2. race ---------------------------------------------------------------------------------------


async def race(base_url: str, key: str, requests: int, identifiers: int, connections: int) -> dict[str, Any]:
    names = [f"race-{j:06d}" for j in range(identifiers)]
    # each identifier's repeats adjacent: they are sent together, before any of them is answered
    order = [names[i * identifiers // requests] for i in range(requests)]
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base_url}/v1/chat/completions"
    gate = asyncio.Semaphore(connections)
    start = asyncio.Event()
    statuses: Counter[str] = Counter()
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    answered: set[str] = set()  # identifiers with at least one 200
    latencies: list[float] = []
    in_flight = peak = 0
    limits = httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=CLIENT_KEEPALIVE_S
    )
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one(identifier: str) -> None:
            nonlocal in_flight, peak
            await start.wait()
            async with gate:
                sent = time.perf_counter()
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    status = _status(await client.post(url, json=_chat(identifier), headers=headers))
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                finally:
                    in_flight -= 1
                done_at = time.perf_counter()
            statuses[status] += 1
            spans[identifier].append((sent, done_at))
            latencies.append((done_at - sent) * 1000)
            if status == "200":
                answered.add(identifier)

        tasks = [asyncio.create_task(one(name)) for name in order]
        await asyncio.sleep(0)  # every task waits at the start
        started = time.perf_counter()
        start.set()
        done, pending = await asyncio.wait(tasks, timeout=STEP_TIMEOUT_S)
        wall_s = time.perf_counter() - started
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # a bug in the client, not a status: raise it
    if pending:
        statuses["not answered in time"] += len(pending)

    def overlap(intervals: list[tuple[float, float]]) -> int:
        """The most of one identifier's requests in flight at one moment."""
        events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
        most = current = 0
        for _, step in events:
            current += step
            most = max(most, current)
        return most

    overlaps = sorted(overlap(spans[name]) for name in names if spans[name])
    return {
        "requests": requests,
        "identifiers": identifiers,
        "connections": connections,
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(latencies) / wall_s, 1),
        "in_flight_peak": peak,
        # Little's law: the time-average of requests in flight
        "in_flight_mean": round(sum(latencies) / 1000 / wall_s, 1),
        "same_identifier_in_flight": {
            "p50": statistics.median(overlaps) if overlaps else 0,
            "min": overlaps[0] if overlaps else 0,
            "max": overlaps[-1] if overlaps else 0,
        },
        "latency_ms": _pct(latencies) if latencies else {},
        "status_counts": dict(sorted(statuses.items())),
        "identifiers_with_a_200": len(answered),
    }


async def database_activity(database_url: str, stop: asyncio.Event, interval_s: float = 0.05) -> dict[str, int]:
    """Until ``stop``: the most of the database's other sessions running a statement at once, and of
    those waiting for a lock (the account's end-user lock, the audit trail's head), from pg_stat_activity."""
    connection = await asyncpg.connect(_dsn(database_url), timeout=ADMIN_TIMEOUT_S)
    peaks = {"active": 0, "waiting_for_a_lock": 0}
    try:
        while not stop.is_set():
            row = await connection.fetchrow(
                "SELECT count(*) FILTER (WHERE state = 'active') AS active, "
                "count(*) FILTER (WHERE state = 'active' AND wait_event_type = 'Lock') AS waiting "
                "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
                timeout=ADMIN_TIMEOUT_S,
            )
            assert row is not None
            peaks["active"] = max(peaks["active"], int(row["active"]))
            peaks["waiting_for_a_lock"] = max(peaks["waiting_for_a_lock"], int(row["waiting"]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        await connection.close()
    return peaks


def access_counts(log: Path, user_id: int, route: str = "/v1/chat/completions") -> dict[str, int]:
    """The account's requests as the gateway's access log has them (``xmark.access``), by status: what
    the gateway read and answered, beside what the client saw."""
    counts: Counter[str] = Counter()
    with log.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if '"xmark.access"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("user_id") == user_id and entry.get("route") == route:
                counts[str(entry.get("status"))] += 1
    return dict(sorted(counts.items()))


async def registry_counts(database_url: str, account_id: int, lengths: int) -> dict[str, Any]:
    """The account's end users, their message IDs, end users without exactly one ID of each of the
    ``lengths`` lengths in use, the audit trail's creations of its end users, and its slot rows
    (``end_users`` rows with no identifier: reserved ahead, merged, given back) with their IDs:
    read by PostgreSQL."""
    connection = await asyncpg.connect(_dsn(database_url), timeout=ADMIN_TIMEOUT_S)
    own = "e.user_id = $1 AND e.identifier IS NOT NULL"
    try:
        end_users = await connection.fetchval(f"SELECT count(*) FROM end_users e WHERE {own}", account_id)
        message_ids = await connection.fetchval(
            f"SELECT count(*) FROM message_ids m JOIN end_users e ON e.id = m.end_user_id WHERE {own}", account_id
        )
        lacking = await connection.fetchval(
            f"""
            SELECT count(*) FROM end_users e
            WHERE {own} AND (SELECT count(DISTINCT (m.bits, m.block_bits)) FROM message_ids m
                             WHERE m.end_user_id = e.id) <> $2
            """,
            account_id,
            lengths,
        )
        audited = await connection.fetchval(
            "SELECT count(*) FROM registry_audit a JOIN end_users e ON a.target_id = e.id::text "
            "WHERE a.action = 'end_user.create' AND a.target_type = 'end_user' AND e.user_id = $1",
            account_id,
        )
        slots = await connection.fetch(
            "SELECT status, count(*) AS n FROM end_users WHERE user_id = $1 AND identifier IS NULL GROUP BY status",
            account_id,
        )
    finally:
        await connection.close()
    return {
        "end_users": int(end_users),
        "message_ids": int(message_ids),
        "end_users_without_one_id_per_length": int(lacking),
        "audit_creations": int(audited),
        "slots": {row["status"]: int(row["n"]) for row in slots},
    }


# -- 3. flood --------------------------------------------------------------------------------------


def _flood_ready() -> bool:
    return True


def flood_process(url: str, key: str, connections: int, start_at: float, seconds: float) -> dict[str, Any]:
    """Run in a process of its own: from ``start_at`` (time.time()) for ``seconds``, ``connections``
    connections each sending a request naming a new identifier as soon as the last one is answered."""

    async def main() -> dict[str, Any]:
        statuses: Counter[str] = Counter()
        limits = httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=CLIENT_KEEPALIVE_S
        )
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            end = time.monotonic() + seconds
            first_refusal: list[float] = []
            started = time.monotonic()

            async def connection() -> None:
                while time.monotonic() < end:
                    identifier = f"invented-{uuid.uuid4().hex}"
                    try:
                        status = _status(await client.post(url, json=_chat(identifier), headers=headers))
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    statuses[status] += 1
                    if status.startswith("429") and not first_refusal:
                        first_refusal.append(time.monotonic() - started)

            await asyncio.wait_for(
                asyncio.gather(*(connection() for _ in range(connections))), seconds + REQUEST_TIMEOUT_S
            )
            elapsed = time.monotonic() - started
        return {
            "seconds": round(elapsed, 2),
            "requests": sum(statuses.values()),
            "requests_per_s": round(sum(statuses.values()) / elapsed, 1),
            "first_429_after_s": round(first_refusal[0], 2) if first_refusal else None,
            "status_counts": dict(sorted(statuses.items())),
        }

    return asyncio.run(main())


async def _one_at_a_time(
    base_url: str, key: str, identifiers: Sequence[str], start_at: float, seconds: float, pause_s: float
) -> list[float]:
    """From ``start_at`` for ``seconds``: requests naming the known ``identifiers`` in turn, one at a time."""
    headers = {"Authorization": f"Bearer {key}"}
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        await _post(client, f"{base_url}/v1/chat/completions", _chat(identifiers[0]), headers)  # the connection
        await asyncio.sleep(max(0.0, start_at - time.time()))
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            body = _chat(identifiers[i % len(identifiers)])
            latencies.append(await _post(client, f"{base_url}/v1/chat/completions", body, headers))
            i += 1
            await asyncio.sleep(pause_s)
    return latencies


async def flood(
    base_url: str, accounts: dict[str, dict[str, Any]], others: Sequence[str], args: argparse.Namespace
) -> dict[str, Any]:
    known = [f"known-{i}" for i in range(KNOWN_PER_ACCOUNT)]
    for name in others:
        await _warm(base_url, accounts[name]["api_key"], known)
    pause_s = args.pause_ms / 1000

    async def window(start_at: float) -> list[list[float]]:
        loops = (
            _one_at_a_time(base_url, accounts[name]["api_key"], known, start_at, args.flood_s, pause_s)
            for name in others
        )
        return list(await asyncio.wait_for(asyncio.gather(*loops), args.flood_s + STEP_TIMEOUT_S))

    _log(f"flood: {len(others)} accounts alone for {args.flood_s:g} s")
    quiet = await window(time.time() + FLOOD_LEAD_S)
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        await asyncio.wait_for(loop.run_in_executor(pool, _flood_ready), STEP_TIMEOUT_S)  # imported, ready
        _log(f"flood: the same beside {args.flood_connections} connections of new identifiers")
        start_at = time.time() + FLOOD_LEAD_S
        flooder = loop.run_in_executor(
            pool,
            flood_process,
            f"{base_url}/v1/chat/completions",
            accounts["flooder"]["api_key"],
            args.flood_connections,
            start_at,
            args.flood_s,
        )
        flooded, flood_result = await asyncio.gather(
            window(start_at), asyncio.wait_for(flooder, args.flood_s + STEP_TIMEOUT_S)
        )
    quiet_all = [x for values in quiet for x in values]
    flooded_all = [x for values in flooded for x in values]
    p50_quiet, p50_flooded = statistics.median(quiet_all), statistics.median(flooded_all)
    return {
        "others": len(others),
        "pause_ms": args.pause_ms,
        "cap": args.flood_cap,
        "others_ms": {
            "unflooded": _pct(quiet_all),
            "flooded": _pct(flooded_all),
            "p50_ratio": round(p50_flooded / p50_quiet, 3),
            "p50_ratio_ci95": _medians_ci95(flooded_all, quiet_all, np.divide),
            "per_account_p50": [
                [round(statistics.median(q), 3), round(statistics.median(f), 3)]
                for q, f in zip(quiet, flooded, strict=True)
            ],
        },
        "flooder": {"connections": args.flood_connections, **flood_result},
    }


# -- the run ---------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    database_url = f"{os.environ.get('XMARK_BENCH_POSTGRES', DEFAULT_POSTGRES)}/{DATABASE}"
    admin_key = generate_api_key().plaintext
    result: dict[str, Any] = {"benchmark": "end_users"}
    with tempfile.TemporaryDirectory(prefix="bench-end-users-") as folder:
        workdir = Path(folder)
        upstream_port = free_port()
        upstream_log = workdir / "upstream.log"
        upstream = _popen(
            [sys.executable, "-m", "benchmarks.fake_upstream", "--port", str(upstream_port), "--tokens", "16"],
            dict(os.environ),
            upstream_log,
        )
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        gateway: Gateway | None = None
        try:
            await _wait_http(f"{upstream_url}/health", upstream, upstream_log, ADMIN_TIMEOUT_S)
            await create_database(database_url, replace=True)
            await asyncio.wait_for(asyncio.to_thread(upgrade_database, database_url), STEP_TIMEOUT_S)
            gateway = Gateway(database_url, upstream_url, workdir, secrets.token_hex(32), secrets.token_hex(32))
            gateway.env.update(
                {
                    "XMARK_WATERMARK_SECRETS": f"{KEY_VERSION}:{secrets.token_hex(32)}",
                    "XMARK_BOOTSTRAP_ADMIN_KEY": admin_key,
                    "XMARK_USER_MAX_PARALLEL_REQUESTS": "0",
                    "XMARK_USER_REQUESTS_PER_MINUTE": "0",
                    "XMARK_USER_TOKENS_PER_MINUTE": "0",
                    "XMARK_END_USER_REQUESTS_PER_MINUTE": "0",
                    "XMARK_END_USER_TOKENS_PER_MINUTE": "0",
                    "XMARK_MAX_QUEUED_REQUESTS": str(2 * max(args.race_connections, args.flood_connections) + 64),
                    "XMARK_MAX_CONNECTIONS": str(max(args.race_connections, args.flood_connections) + 64),
                    "XMARK_END_USERS_NEW_PER_MINUTE": "0",
                    # the race's client (1,000 connections in one process, on the gateway's cores)
                    # lags seconds behind its answers; past the default 5 s idle bound the gateway
                    # closes connections the client is about to reuse (``access_counts`` tells those
                    # requests apart); the idle bound is not what this measures
                    "XMARK_KEEP_ALIVE_TIMEOUT_S": str(RACE_KEEP_ALIVE_S),
                }
            )
            if args.database_timeout_s is not None:
                gateway.env["XMARK_DATABASE_TIMEOUT_S"] = str(args.database_timeout_s)
            startup_s = await gateway.start()
            _log(f"gateway ready in {startup_s:.1f} s")
            others = [f"other-{i + 1}" for i in range(args.others)]
            accounts = await _accounts(gateway.url, admin_key, ["first", "race", "flooder", *others])
            lengths = accounts["race"]["lengths"]

            _log(f"first vs known: {args.first} requests each")
            first = await asyncio.wait_for(
                first_vs_known(gateway.url, upstream_url, accounts["first"]["api_key"], args.first), STEP_TIMEOUT_S
            )
            result["first_vs_known"] = first
            print(_first_table(first), flush=True)

            _log(f"race: {args.race_requests} requests, {args.race_identifiers} identifiers")
            raced_over = asyncio.Event()
            sampler = asyncio.create_task(database_activity(database_url, raced_over))
            try:
                raced = await race(
                    gateway.url,
                    accounts["race"]["api_key"],
                    args.race_requests,
                    args.race_identifiers,
                    args.race_connections,
                )
            finally:
                raced_over.set()
            raced["postgresql_sessions_peak"] = await asyncio.wait_for(sampler, ADMIN_TIMEOUT_S)
            raced["lengths_in_use"] = [list(length) for length in lengths]
            raced["database"] = await registry_counts(database_url, accounts["race"]["id"], len(lengths))
            raced["gateway_answered"] = access_counts(gateway.log, accounts["race"]["id"])
            result["race"] = raced
            print(_race_table(raced), flush=True)

            gateway.stop()
            gateway.env["XMARK_END_USERS_MAX_PER_ACCOUNT"] = str(args.flood_cap)
            del gateway.env["XMARK_END_USERS_NEW_PER_MINUTE"]  # the product's default
            await gateway.start()
            flooded = await flood(gateway.url, accounts, others, args)
            flooded["database"] = await registry_counts(database_url, accounts["flooder"]["id"], len(lengths))
            result["flood"] = flooded
            print(_flood_table(flooded), flush=True)
        finally:
            if gateway is not None:
                gateway.stop()
            stop_server(upstream)
            with contextlib.suppress(Exception):
                await drop_database(database_url)
    result["goals"] = _goals(result, args)
    result["config"] = {
        "first": args.first,
        "race_requests": args.race_requests,
        "race_identifiers": args.race_identifiers,
        "race_connections": args.race_connections,
        "flood_s": args.flood_s,
        "flood_connections": args.flood_connections,
        "flood_cap": args.flood_cap,
        "others": args.others,
        "pause_ms": args.pause_ms,
        "database_timeout_s": args.database_timeout_s,
    }
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    return result


def _goals(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    first, raced, flooded = result["first_vs_known"], result["race"], result["flood"]
    lengths = len(raced["lengths_in_use"])
    five_xx = sum(n for status, n in raced["status_counts"].items() if not status[:1].isdigit() or status[0] == "5")
    # a request the client lost on a connection the gateway closed before reading it (keep-alive's
    # race with a lagging client: nothing reached the application) is told apart from a 5xx by the
    # gateway's access log, which holds every request it read and what it answered
    answered = raced["gateway_answered"]
    gateway_5xx = sum(n for status, n in answered.items() if status.startswith("5"))
    never_read = raced["requests"] - sum(answered.values())
    client_errors = sum(n for status, n in raced["status_counts"].items() if not status[:1].isdigit())
    statuses = flooded["flooder"]["status_counts"]
    refused = statuses.get(f"429 {LIMIT_CODE}", 0)
    return {
        "first_minus_known_p50_ms": {
            "goal": f"<= {GOALS['first_minus_known_p50_ms']}",
            "measured": first["first_minus_known_p50_ms"],
            "ci95": first["first_minus_known_p50_ci95"],
            "met": first["first_minus_known_p50_ms"] <= GOALS["first_minus_known_p50_ms"],
        },
        "race_exact": {
            "goal": f"{args.race_identifiers} end users, {args.race_identifiers * lengths} message IDs, no 5xx",
            "measured": {
                **raced["database"],
                "5xx_or_no_answer": five_xx,
                "gateway_5xx": gateway_5xx,
                "never_read_by_the_gateway": never_read,
            },
            "met": raced["database"]["end_users"] == args.race_identifiers
            and raced["database"]["message_ids"] == args.race_identifiers * lengths
            and raced["database"]["end_users_without_one_id_per_length"] == 0
            and gateway_5xx == 0
            and five_xx == client_errors == never_read,
        },
        "flood_stops_at_cap": {
            "goal": f"{args.flood_cap} accepted, the rest 429 {LIMIT_CODE}",
            "measured": {"200": statuses.get("200", 0), "429": refused, "end_users": flooded["database"]["end_users"]},
            "met": statuses.get("200", 0) == args.flood_cap
            and flooded["database"]["end_users"] == args.flood_cap
            and refused == flooded["flooder"]["requests"] - args.flood_cap,
        },
        "flood_p50_ratio": {
            "goal": f"<= {GOALS['flood_p50_ratio']}",
            "measured": flooded["others_ms"]["p50_ratio"],
            "ci95": flooded["others_ms"]["p50_ratio_ci95"],
            "met": flooded["others_ms"]["p50_ratio"] <= GOALS["flood_p50_ratio"],
        },
    }


def _first_table(first: dict[str, Any]) -> str:
    latency, gateway = first["latency_ms"], first["gateway_ms"]
    lines = [f"1. first vs known ({first['requests_each']} each, one at a time)", "   latency ms: p50 / p95"]
    for name in ("direct", "first", "known"):
        lines.append(f"   {name:<8}{latency[name]['p50']:>9.3f} /{latency[name]['p95']:>9.3f}")
    lines.append(
        f"   gateway time p50: first {gateway['first']['p50']} ms, known {gateway['known']['p50']} ms; "
        f"p95: first {gateway['first']['p95']} ms, known {gateway['known']['p95']} ms"
    )
    lines.append(
        f"   first - known p50: {first['first_minus_known_p50_ms']} ms, 95 % CI {first['first_minus_known_p50_ci95']}"
        f"; first sights' gateway p50 by quarter: {first['first_gateway_p50_by_quarter_ms']}"
    )
    return "\n".join(lines)


def _race_table(raced: dict[str, Any]) -> str:
    same = raced["same_identifier_in_flight"]
    return "\n".join(
        [
            f"2. race: {raced['requests']} requests, {raced['identifiers']} identifiers, "
            f"{raced['connections']} connections, {raced['wall_s']} s ({raced['requests_per_s']}/s)",
            f"   in flight: peak {raced['in_flight_peak']}, mean {raced['in_flight_mean']}; one identifier's "
            f"requests in flight at once: p50 {same['p50']}, min {same['min']}, max {same['max']}",
            f"   the gateway's PostgreSQL sessions at once (peak): {raced['postgresql_sessions_peak']}",
            f"   statuses: {raced['status_counts']}; identifiers with a 200: {raced['identifiers_with_a_200']}",
            f"   the gateway's access log, this account: {raced['gateway_answered']}",
            f"   PostgreSQL: {raced['database']} (lengths in use: {raced['lengths_in_use']})",
        ]
    )


def _flood_table(flooded: dict[str, Any]) -> str:
    others, flooder = flooded["others_ms"], flooded["flooder"]
    return "\n".join(
        [
            f"3. flood: {flooder['connections']} connections for {flooder['seconds']} s, cap {flooded['cap']}; "
            f"{flooded['others']} other accounts one at a time, {flooded['pause_ms']:g} ms apart",
            f"   others' p50: {others['unflooded']['p50']} ms alone, {others['flooded']['p50']} ms flooded, "
            f"ratio {others['p50_ratio']} (95 % CI {others['p50_ratio_ci95']}); "
            f"p99 {others['unflooded']['p99']} -> {others['flooded']['p99']} ms",
            f"   flooder: {flooder['requests']} requests ({flooder['requests_per_s']}/s), first 429 after "
            f"{flooder['first_429_after_s']} s, statuses {flooder['status_counts']}",
            f"   PostgreSQL: {flooded['database']}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=1000, help="first-sight requests (and as many known ones)")
    parser.add_argument("--race-requests", type=int, default=10_000)
    parser.add_argument("--race-identifiers", type=int, default=1000)
    parser.add_argument("--race-connections", type=int, default=1000, help="connections the race is sent over")
    parser.add_argument("--flood-s", type=float, default=30.0, help="seconds of each flood window (alone, flooded)")
    parser.add_argument("--flood-connections", type=int, default=16)
    parser.add_argument("--flood-cap", type=int, default=200, help="XMARK_END_USERS_MAX_PER_ACCOUNT in the flood")
    parser.add_argument("--others", type=int, default=3, help="accounts measured beside the flood")
    parser.add_argument("--pause-ms", type=float, default=10.0, help="each other account's pause between requests")
    parser.add_argument(
        "--database-timeout-s",
        type=float,
        default=None,
        help="XMARK_DATABASE_TIMEOUT_S of the gateway (default: the product's); a race's requests that wait "
        "for the account's end-user lock or a pooled connection past it get 503",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    args = parser.parse_args()
    if args.race_requests < args.race_identifiers:
        parser.error("--race-requests must be at least --race-identifiers")
    if args.flood_cap < KNOWN_PER_ACCOUNT:
        parser.error(f"--flood-cap must be at least {KNOWN_PER_ACCOUNT} (the other accounts' known end users)")
    result = asyncio.run(run(args))
    for name, goal in result["goals"].items():
        print(f"goal {name:<26} {goal['goal']:<44} {'met' if goal['met'] else 'NOT MET'}  {goal['measured']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
