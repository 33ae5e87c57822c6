"""``make bench-auth-flood``: a flood of made-up API keys against one valid user, with the
per-address budget of failed authentications (service/services/auth_edge.py) on and off.

A gateway process served as ``xmark serve`` serves it (``service.server`` options, the fake backend),
on a PostgreSQL database of its own (created and dropped here, on the server of
``XMARK_TEST_DATABASE_URL``). Every client connects from 127.0.0.1: the flood and the valid user
share one address, the hardest case for the valid user, and what a same-host proxy that is not
declared trusted makes of every client. Per gateway (``edge: default``, the product's defaults,
which count loopback like any address; ``edge: loopback-exempt``, ``XMARK_AUTH_EDGE_EXEMPT`` set to
loopback, the default before it was emptied; ``edge: off``, ``XMARK_AUTH_EDGE_FAILURES=0``):

1. unflooded: the valid user alone sends ``GET /v1/models`` (its key cached after the first call)
   one request after another, ``--pause-ms`` apart, for ``--quiet-s`` seconds;
2. flooded: the same, while ``--connections`` connections send distinct, well-formed random keys
   as fast as the gateway answers them for ``--flood-s`` seconds.

Reported per gateway: the valid user's p50/p99 in both phases and their ratio, the flood's
requests and status counts, and the database transactions during the flood (``pg_stat_database``
``xact_commit + xact_rollback`` of the gateway's database, read from the ``postgres`` database so
the reading itself is not counted): in all, and per second from ``--settle-s`` into the flood to
its end less the gateway's idle rate (measured in the unflooded phase), i.e. what the flood costs
once its budget is spent; next to the gateway's own count of API-key reads
(``xmark_auth_key_reads_total``) over the same time. A table, then one JSON object on the last line.

    python -m benchmarks.auth_flood [--flood-s 30] [--connections 16] [--budget N] [--edge-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.launch import free_port
from benchmarks.pg_admin import create_database, database_name, drop_database, maintenance_url, sibling_url
from service.db import upgrade_database
from service.security import generate_api_key
from tests.service.live_gateway import environment_process

DEFAULT_SERVER_URL = "postgresql+asyncpg://root@127.0.0.1:5432/postgres"
# An idle backend reports its pending statistics to pg_stat_database up to 10 s late (PostgreSQL 15's
# PGSTAT_IDLE_INTERVAL): each reading waits that long after the moment it stands for, and the steady
# state starts that long after the budget is spent, so no transaction is counted in the wrong phase.
STATS_SETTLE_S = 11.0


async def transactions(database_url: str) -> int:
    """Transactions committed and rolled back in the database of ``database_url`` so far."""
    engine = create_async_engine(maintenance_url(database_url), poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            value = await connection.scalar(
                text("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :name"),
                {"name": database_name(database_url)},
            )
    finally:
        await engine.dispose()
    return int(value or 0)


def counter(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", metrics, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def valid_user(session: aiohttp.ClientSession, url: str, key: str, seconds: float, pause_s: float) -> list[float]:
    """Latencies (ms) of the valid user's sequential requests for ``seconds``; each must be 200."""
    headers = {"Authorization": f"Bearer {key}"}
    latencies: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        async with session.get(url, headers=headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"the valid user got {response.status}")
        latencies.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(pause_s)
    return latencies


async def flood(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, statuses: dict[str, int]) -> None:
    """One connection's worth of distinct, well-formed random keys until ``stop``."""
    while not stop.is_set():
        headers = {"Authorization": f"Bearer {generate_api_key().plaintext}"}
        try:
            async with session.get(url, headers=headers) as response:
                await response.read()
                status = str(response.status)
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        statuses[status] = statuses.get(status, 0) + 1


async def run_gateway(args: argparse.Namespace, server_url: str, edge: str, work: Path) -> dict[str, Any]:
    database_url = sibling_url(server_url, f"xmark_auth_flood_{uuid.uuid4().hex[:8]}")
    await create_database(database_url)
    try:
        await asyncio.to_thread(upgrade_database, database_url)
        key = generate_api_key().plaintext
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        env = {
            "XMARK_DATABASE_URL": database_url,
            "XMARK_VAR_DIR": str(work / f"var-{edge}"),
            "XMARK_WATERMARK_SECRETS": "v1:auth-flood-watermark-secret-6c1e9a0f3b7d2584",
            "XMARK_API_KEY_PEPPER": "auth-flood-api-key-pepper-b03f7e2a9c5d1846",
            "XMARK_BOOTSTRAP_ADMIN_KEY": key,
            "XMARK_PORT": str(port),
            "XMARK_LOG_LEVEL": "WARNING",
            "XMARK_AUTH_CACHE_TTL_S": "120",
        }
        # the edge's other settings are the product's defaults
        if edge == "off":
            env["XMARK_AUTH_EDGE_FAILURES"] = "0"
        elif args.budget is not None:
            env["XMARK_AUTH_EDGE_FAILURES"] = str(args.budget)
        if edge == "loopback-exempt":
            env["XMARK_AUTH_EDGE_EXEMPT"] = "127.0.0.0/8,::1/128"
        url = f"{base_url}/v1/models"
        with environment_process(env, base_url, work / f"gateway-{edge}.log"):
            connector = aiohttp.TCPConnector(limit=args.connections + 4)
            async with aiohttp.ClientSession(connector=connector) as session:
                await valid_user(session, url, key, 0.5, args.pause_ms / 1000)  # cached, warm
                await asyncio.sleep(STATS_SETTLE_S)
                quiet_xacts = await transactions(database_url)
                quiet_started = time.monotonic()
                quiet = await valid_user(session, url, key, args.quiet_s, args.pause_ms / 1000)
                await asyncio.sleep(STATS_SETTLE_S)
                quiet_xacts = await transactions(database_url) - quiet_xacts
                quiet_s = time.monotonic() - quiet_started
                metrics_before = (await asyncio.to_thread(httpx.get, f"{base_url}/metrics", timeout=10)).text
                xacts_before = await transactions(database_url)
                stop = asyncio.Event()
                statuses: dict[str, int] = {}
                flooders = [asyncio.create_task(flood(session, url, stop, statuses)) for _ in range(args.connections)]
                flood_started = time.monotonic()

                async def steady_state() -> tuple[float, int, str]:
                    # once the budget is spent (and the reads under way then have finished)
                    await asyncio.sleep(args.settle_s)
                    metrics = (await asyncio.to_thread(httpx.get, f"{base_url}/metrics", timeout=10)).text
                    return time.monotonic(), await transactions(database_url), metrics

                settled = asyncio.create_task(steady_state())
                flooded = await valid_user(session, url, key, args.flood_s, args.pause_ms / 1000)
                stop.set()
                await asyncio.gather(*flooders)
                flood_ended = time.monotonic()
                flood_s = flood_ended - flood_started
                settled_at, settled_xacts, metrics_settled = await settled
                await asyncio.sleep(STATS_SETTLE_S)
                end_xacts = await transactions(database_url)
                xacts = end_xacts - xacts_before
                metrics_after = (await asyncio.to_thread(httpx.get, f"{base_url}/metrics", timeout=10)).text
    finally:
        await drop_database(database_url)

    def delta(name: str, **labels: str) -> float:
        return counter(metrics_after, name, **labels) - counter(metrics_before, name, **labels)

    idle_per_s = quiet_xacts / quiet_s  # the gateway's own background transactions
    steady_s = flood_ended - settled_at
    steady_reads = counter(metrics_after, "xmark_auth_key_reads_total") - counter(
        metrics_settled, "xmark_auth_key_reads_total"
    )
    p50_quiet, p50_flooded = statistics.median(quiet), statistics.median(flooded)
    return {
        "edge": edge,
        "valid_user": {
            "requests_unflooded": len(quiet),
            "requests_flooded": len(flooded),
            "p50_ms_unflooded": round(p50_quiet, 2),
            "p50_ms_flooded": round(p50_flooded, 2),
            "p99_ms_unflooded": round(_percentile(quiet, 0.99), 2),
            "p99_ms_flooded": round(_percentile(flooded, 0.99), 2),
            "p50_ratio": round(p50_flooded / p50_quiet, 2),
        },
        "flood": {
            "connections": args.connections,
            "seconds": round(flood_s, 2),
            "requests": sum(statuses.values()),
            "requests_per_s": round(sum(statuses.values()) / flood_s, 1),
            "status_counts": statuses,
        },
        "database": {
            "idle_transactions_per_s": round(idle_per_s, 2),
            "transactions": xacts,
            "transactions_per_s": round(xacts / flood_s, 2),
            # from `settle_s` into the flood to its end, less the idle rate: what the flood costs
            # once its budget is spent
            # (None when the flood is not longer than `settle_s`: no steady state was measured)
            "flood_transactions_per_s_after_budget": (
                round(max((end_xacts - settled_xacts) / steady_s - idle_per_s, 0.0), 2) if steady_s > 0 else None
            ),
            "key_reads_per_s_after_budget": round(steady_reads / steady_s, 2) if steady_s > 0 else None,
            "key_reads": int(delta("xmark_auth_key_reads_total")),
            "key_reads_refused": int(delta("xmark_auth_key_reads_total", result="refused")),
        },
        "edge_refusals": int(delta("xmark_auth_edge_refusals_total")),
        "edge_backoffs": int(delta("xmark_auth_edge_backoffs_total")),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    server_url = os.environ.get("XMARK_TEST_DATABASE_URL", DEFAULT_SERVER_URL)
    work = Path(tempfile.mkdtemp(prefix="xmark-auth-flood-"))
    modes = ["default"] if args.edge_only else ["default", "loopback-exempt", "off"]
    runs = [await run_gateway(args, server_url, mode, work) for mode in modes]
    on = runs[0]
    return {
        "benchmark": "auth_flood",
        "budget": args.budget,
        "pause_ms": args.pause_ms,
        "runs": runs,
        "goals": {
            "p50_within_2x": on["valid_user"]["p50_ratio"] <= 2.0,
            "transactions_per_10_s_at_most_300": on["database"]["transactions_per_s"] * 10 <= 300,
            "flood_queries_per_s_after_budget_at_most_1": (
                None
                if on["database"]["flood_transactions_per_s_after_budget"] is None
                else on["database"]["flood_transactions_per_s_after_budget"] <= 1.0
            ),
        },
    }


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{'edge':<16} {'p50 quiet':>10} {'p50 flood':>10} {'ratio':>6} {'p99 flood':>10} "
        f"{'flood req/s':>12} {'db xact/s':>10} {'after budget':>13} {'key reads/s':>12}"
    ]
    for run in result["runs"]:
        user, database = run["valid_user"], run["database"]
        lines.append(
            f"{run['edge']:<16} {user['p50_ms_unflooded']:>10} {user['p50_ms_flooded']:>10} {user['p50_ratio']:>6} "
            f"{user['p99_ms_flooded']:>10} {run['flood']['requests_per_s']:>12} {database['transactions_per_s']:>10} "
            f"{database['flood_transactions_per_s_after_budget']!s:>13} "
            f"{database['key_reads_per_s_after_budget']!s:>12}"
        )
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument("--quiet-s", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=13.0,
        help="flood seconds before the steady state (the budget's reads reported)",
    )
    parser.add_argument("--pause-ms", type=float, default=10.0, help="the valid user's pause between requests")
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="XMARK_AUTH_EDGE_FAILURES of the gateways with the edge (default: the product's)",
    )
    parser.add_argument("--edge-only", action="store_true", help="only the gateway on the product's defaults")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(_table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    cli()
