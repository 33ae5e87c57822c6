"""User creations on the embedded default (SQLite) with many at once: answers, latency, refusals.

    python -m benchmarks.sqlite_writes                       # 32 parallel creators, 5,000 users
    python -m benchmarks.sqlite_writes --parallel 8 --users 2000 --synchronous normal

``xmark serve`` runs in a process of its own on a fresh SQLite file (built by the migrations) in
a temporary folder, with the vLLM backend pointed at a port nobody listens on (creating users
needs no model); ``--parallel`` clients of this process create ``--users`` users through
``POST /admin/users`` over keep-alive connections. Printed: every status with its count, the
non-2xx count, latency p50/p99/max and users per second; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch import MODEL_NAME, free_port
from service.db import upgrade_database
from service.security import generate_api_key

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _wait_ready(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError("the gateway exited during start-up")
            try:
                if (await client.get(f"{base_url}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start in time")
            await asyncio.sleep(0.2)


async def _create(base_url: str, admin_key: str, users: int, parallel: int) -> tuple[Counter[int], list[float], float]:
    numbers = itertools.count()
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=parallel, max_keepalive_connections=parallel)
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def creator() -> None:
            while (number := next(numbers)) < users:
                started = time.perf_counter()
                response = await client.post("/admin/users", json={"name": f"bench-{number}"}, headers=headers)
                latencies.append(time.perf_counter() - started)
                statuses[response.status_code] += 1

        started = time.perf_counter()
        await asyncio.gather(*(creator() for _ in range(parallel)))
        elapsed = time.perf_counter() - started
    return statuses, latencies, elapsed


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="xmark-sqlite-writes-") as folder:
        var = Path(folder) / "var"
        var.mkdir()
        database_url = f"sqlite+aiosqlite:///{var / 'xmark.db'}"
        await asyncio.to_thread(upgrade_database, database_url)
        admin_key = generate_api_key().plaintext
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("XMARK_")}
        env.update(
            {
                "XMARK_DATABASE_URL": database_url,
                "XMARK_VAR_DIR": str(var),
                "XMARK_WATERMARK_SECRETS": f"v1:{secrets.token_hex(32)}",
                "XMARK_API_KEY_PEPPER": secrets.token_hex(32),
                "XMARK_BOOTSTRAP_ADMIN_KEY": admin_key,
                "XMARK_BACKEND": "vllm",
                "XMARK_VLLM_URLS": f"http://127.0.0.1:{free_port()}",  # nobody listens: no model needed
                "XMARK_MODEL_PATH": str(REPO_ROOT / "var" / "models" / MODEL_NAME),
                "XMARK_MODEL_NAME": MODEL_NAME,
                "XMARK_LOG_LEVEL": "WARNING",
                "XMARK_SQLITE_SYNCHRONOUS": args.synchronous,
                "PYTHONPATH": str(REPO_ROOT),
            }
        )
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        log = Path(folder) / "gateway.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=sink, stderr=sink)  # noqa: ASYNC220
        try:
            base_url = f"http://127.0.0.1:{port}"
            await _wait_ready(base_url, process)
            statuses, latencies, elapsed = await _create(base_url, admin_key, args.users, args.parallel)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    non_2xx = sum(count for status, count in statuses.items() if not 200 <= status < 300)
    milliseconds = [1000 * seconds for seconds in latencies]
    return {
        "parallel": args.parallel,
        "users": args.users,
        "synchronous": args.synchronous,
        "statuses": {str(status): count for status, count in sorted(statuses.items())},
        "non_2xx": non_2xx,
        "p50_ms": round(statistics.median(milliseconds), 1),
        "p99_ms": round(_percentile(milliseconds, 0.99), 1),
        "max_ms": round(max(milliseconds), 1),
        "users_per_s": round(args.users / elapsed, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, default=32, help="clients creating users at once (32)")
    parser.add_argument("--users", type=int, default=5000, help="users created in all (5000)")
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full", help="XMARK_SQLITE_SYNCHRONOUS")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(f"{result['users']} users by {result['parallel']} parallel creators (synchronous={result['synchronous']})")
    print(f"statuses: {result['statuses']}  non-2xx: {result['non_2xx']}")
    print(f"latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms")
    print(f"{result['users_per_s']} users/s")
    print(json.dumps(result))
    return 0 if result["non_2xx"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
