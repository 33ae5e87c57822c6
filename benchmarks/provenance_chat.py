"""Chat latency with the provenance sketch on and off, in one run, on one gateway.

    python -m benchmarks.provenance_chat --json

The gateway runs in this process (uvicorn on a local port, PostgreSQL, API-key auth, the access
log at INFO, its generation record written after the response, as by default). The same greedy
chat request (an essay prompt, ``--max-tokens`` tokens, 64 by default) is sent ``--requests``
times per mode, back to back (each request starts as soon as the previous response is read, so the
work the gateway does after a response, the record and its sketch included, competes with the next
request as it does in service). The modes alternate in ABBA blocks:

* ``on``: the gateway as configured by default (``XMARK_PROVENANCE=on``): every record carries the
  keyed content sketch of its completion;
* ``off``: the same process with no sketcher (what ``XMARK_PROVENANCE=off`` gives), switched
  between requests on the running app.

Reported per mode: the round trip (``latency_ms``) and the round trip minus the model time the
gateway reports for that very request (``Server-Timing: model``; ``overhead_ms``: everything but
the model, so without the model step's run-to-run spread). ``on_minus_off`` holds the difference
of the medians and a bootstrap 95 % interval of it (seeded, 5,000 resamples): the change the
sketch brings to chat latency. Afterwards the records are counted: the ``on`` requests' records
must carry a sketch and the ``off`` ones none (the switch is checked, not assumed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from pydantic import SecretStr
from sqlalchemy import func, select

from benchmarks.launch import free_port
from benchmarks.pg_admin import drop_database
from benchmarks.service_bench import (
    TRACE_PROMPTS,
    _fresh_database,
    _gateway_in_process,
    _percentiles,
    _seed,
    _server_timing,
)
from service.config import Settings
from service.db import create_engine, create_sessionmaker, session_scope
from service.models import Generation

MODES = ("on", "off")
WARM_UP = 4


def _difference_ci95(on: list[float], off: list[float], resamples: int = 5000) -> list[float]:
    """Percentile-bootstrap 95 % interval of median(on) - median(off), each mode resampled alone."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(on), np.asarray(off)
    ma = np.median(a[rng.integers(0, a.size, size=(resamples, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, size=(resamples, b.size))], axis=1)
    return [round(float(q), 3) for q in np.percentile(ma - mb, [2.5, 97.5])]


async def _measure(app: Any, base_url: str, api_key: str, model: str, requests: int, max_tokens: int) -> dict[str, Any]:
    resources = app.state.resources
    sketcher = resources.sketcher
    if sketcher is None:
        raise RuntimeError("the gateway runs with XMARK_PROVENANCE=off: nothing to compare")
    body = {
        "model": model,
        "messages": [{"role": "user", "content": TRACE_PROMPTS[0]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    latency: dict[str, list[float]] = {mode: [] for mode in MODES}
    overhead: dict[str, list[float]] = {mode: [] for mode in MODES}
    tokens: dict[str, set[int]] = {mode: set() for mode in MODES}
    request_ids: dict[str, list[str]] = {mode: [] for mode in MODES}
    order = [MODES[i % 4 in (1, 2)] for i in range(2 * (requests + WARM_UP))]  # on off off on ...
    async with aiohttp.ClientSession(
        base_url=base_url,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=aiohttp.ClientTimeout(total=120),
    ) as client:
        for index, mode in enumerate(order):
            resources.sketcher = sketcher if mode == "on" else None
            started = time.perf_counter()
            async with client.post("/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                data = await response.json()
                timings = _server_timing(response.headers.getall("Server-Timing", []))
            elapsed = (time.perf_counter() - started) * 1000
            if "model" not in timings:
                raise RuntimeError(f"the gateway sent no model Server-Timing: {timings}")
            request_ids[mode].append(data["id"])
            if index >= 2 * WARM_UP:
                latency[mode].append(elapsed)
                overhead[mode].append(elapsed - timings["model"])
                tokens[mode].add(int(data["usage"]["completion_tokens"]))
    resources.sketcher = sketcher
    result: dict[str, Any] = {"requests_per_mode": requests, "max_tokens": max_tokens}
    for mode in MODES:
        result[mode] = {
            "latency_ms": _percentiles(latency[mode]),
            "overhead_ms": _percentiles(overhead[mode]),
            "completion_tokens": sorted(tokens[mode]),
        }
    result["on_minus_off"] = {
        name: {
            "p50_difference": round(
                float(np.median(samples["on"]) - np.median(samples["off"])),
                3,
            ),
            "ci95": _difference_ci95(samples["on"], samples["off"]),
        }
        for name, samples in (("latency_ms", latency), ("overhead_ms", overhead))
    }
    result["request_ids"] = request_ids
    return result


async def _count_sketched(settings: Settings, request_ids: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    engine = create_engine(settings)
    try:
        counts: dict[str, dict[str, int]] = {}
        async with session_scope(create_sessionmaker(engine)) as session:
            for mode, ids in request_ids.items():
                rows = (
                    await session.execute(
                        select(Generation.sketch_terms.is_not(None), func.count())
                        .where(Generation.request_id.in_(ids))
                        .group_by(Generation.sketch_terms.is_not(None))
                    )
                ).all()
                by_flag = {bool(flag): int(count) for flag, count in rows}
                counts[mode] = {"records": sum(by_flag.values()), "sketched": by_flag.get(True, 0)}
        return counts
    finally:
        await engine.dispose()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    pepper = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="xmark-bench-") as var_dir:
        settings = Settings(
            database_url=args.database_url,
            var_dir=Path(var_dir),
            watermark_secrets=SecretStr(f"bench1:{secrets.token_urlsafe(32)}"),
            api_key_pepper=SecretStr(pepper),
            model_path=args.model_path.resolve(),
            keyring_refresh_seconds=0,
            # greedy answers (temperature 0: the same answer with the sketch on and off) need the
            # biasing scheme: the distortion-free default refuses them
            watermark_scheme="xmark",
        )
        await _fresh_database(settings.database_url)
        try:
            seeded = await _seed(settings, pepper, users=10, traced=1)
            port = free_port()
            async with _gateway_in_process(settings, port, Path(var_dir) / "gateway.log") as app:
                base_url = f"http://127.0.0.1:{port}"
                result = await _measure(
                    app, base_url, seeded.chat_key, settings.model_name, args.requests, args.max_tokens
                )
                await asyncio.wait_for(app.state.bench_in_flight.settled(), timeout=60)
                await asyncio.sleep(1.0)  # records are written after their responses
            records = await _count_sketched(settings, result.pop("request_ids"))
        finally:
            await drop_database(settings.database_url)
    expected = args.requests + WARM_UP  # records per mode, warm-up included
    result["records"] = records
    result["switch_checked"] = (
        records["on"]["records"] == expected
        and records["on"]["sketched"] == expected
        and records["off"]["records"] == expected
        and records["off"]["sketched"] == 0
    )
    result["machine"] = {
        "processor": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_at_start": load_at_start,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    result["command"] = "python -m benchmarks.provenance_chat " + " ".join(sys.argv[1:])
    return result


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'mode':<5} {'latency p50':>12} {'p99':>9} {'overhead p50':>13} {'p99':>8}  tokens"]
    for mode in MODES:
        entry = result[mode]
        lines.append(
            f"{mode:<5} {entry['latency_ms']['p50']:>12.2f} {entry['latency_ms']['p99']:>9.2f} "
            f"{entry['overhead_ms']['p50']:>13.3f} {entry['overhead_ms']['p99']:>8.3f}  {entry['completion_tokens']}"
        )
    for name, diff in result["on_minus_off"].items():
        lines.append(f"on - off, {name} p50: {diff['p50_difference']:+.3f} (95 % CI {diff['ci95']})")
    lines.append(f"records: {result['records']}; switch checked: {result['switch_checked']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.provenance_chat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument(
        "--database-url",
        default="postgresql+asyncpg://root@127.0.0.1:5432/xmark_provenance_chat",
        help="database to create, use and drop (default: %(default)s)",
    )
    parser.add_argument("--model-path", type=Path, default=Path("var/models/smollm2-135m-instruct"))
    parser.add_argument("--requests", type=int, default=100, help="measured requests per mode (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(_table(result))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0 if result["switch_checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
