"""Gateway benchmark: per-request gateway overhead and /trace throughput (counting and likelihood
decoders) with 10,000 users.

    python -m benchmarks.service_bench --json

1. Gateway overhead: the gateway runs in this process (uvicorn on a local port, PostgreSQL,
   API-key auth, the access log at INFO, recording), and the same non-streamed chat request
   (greedy, one token by default) goes in turn straight to its own backend object
   (``app.state.resources.backend.generate``: the same model instance, thread and event loop), then
   through the gateway with aiohttp, then with httpx. ``overhead_ms`` holds percentiles of the
   paired differences (aiohttp call minus the direct call just before it): everything the
   gateway adds (HTTP, auth, validation, the generation record where it precedes the response,
   metrics, the log line, serialisation) plus a lean client's own cost, and nothing that differs
   between two copies of the model. ``overhead_with_httpx_ms`` is the same with httpx, the
   OpenAI SDK's client, whose own cost is higher and not the gateway's. Each carries
   ``p50_ci95``, a bootstrap 95 % interval of its p50: the model step's own run-to-run spread
   (tens of ms on a shared CPU) makes the p50 of the differences uncertain by a few ms. Client
   and gateway share this process's event loop, so the gateway's work after a response (its
   generation record, by default) can still hold up the client reading it.
   ``overhead_per_request_ms`` is each aiohttp call minus the model time the gateway reports for
   that very call in its ``Server-Timing`` header (the backend's ``generate`` inside the request):
   the same overhead without the model's spread, known to a fraction of a millisecond. Each call
   starts once the gateway has finished the previous ones, their work after the response
   included, so none of it lands inside a direct call.
2. Gateway overhead per request, in production form: the same request against the gateway
   started as in production (``xmark serve --workers N``, N = this machine's CPUs unless
   ``--workers`` says otherwise; its own processes), each one's overhead being its
   aiohttp round trip minus the model time the gateway reports (``Server-Timing: model``), and
   ``in_app_ms`` the part spent inside the app before the response starts (``app`` minus
   ``model``). Two processes hand each request and response over through the kernel: on a VM
   whose CPUs idle during the model step, waking the waiting client costs about a millisecond
   more than the same hand-off between busy processes, which is machine, not gateway, time.
3. /trace throughput: 10,000 users are registered through the user repository (message IDs
   from the production allocator), watermarked ~300-token texts are generated for a few of
   them, and concurrent /trace requests from this process run for a fixed time against the
   gateway started as in production (``xmark serve --workers N``). With N > 1 the same load then
   runs against one worker (``one_worker``, ``speedup_vs_one_worker``), in the same run.
4. /trace with the likelihood decoder (``trace_likelihood``): the same traced users' texts of
   ~150 (``short``) and ~300 (``long``) tokens, ``decoder: likelihood`` (one forward pass of the
   model per trace in each worker), against the production gateway with all its workers. Where
   the forward pass runs in bfloat16 (``XMARK_TRACE_SCORER_DTYPE=auto`` on a CPU with native
   bfloat16), the short load is run again with float32 (``short_float32``,
   ``short_speedup_vs_float32``), in the same run.

Both gateways are measured once their start-up work is done (the model loaded, the trace null
distributions prepared). Everything runs against a dedicated PostgreSQL database that is created
and dropped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI

try:
    import uvloop
except ImportError:  # pragma: no cover - not on this platform
    uvloop = None  # type: ignore[assignment]
from pydantic import SecretStr

from benchmarks.launch import free_port
from benchmarks.pg_admin import create_database, drop_database
from service.app import create_app
from service.backends import Backend
from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.scoring import resolve_scorer_dtype
from service.config import Settings, load_secrets
from service.db import create_engine, create_sessionmaker, session_scope, upgrade_database
from service.keyring import params_from_settings
from service.logging import configure_logging
from service.models import User
from service.repositories.unit import Repositories
from service.repositories.users import UserRepository
from service.security import ApiKeyHasher
from service.services.users import UserService
from xmark_core import Message, WatermarkKey
from xmark_core.message import MessageAllocator

# A short system message replaces the chat template's default one: a shorter prompt makes the
# model's time, and its run-to-run noise, small next to what is measured.
OVERHEAD_SYSTEM = "Be brief."
OVERHEAD_PROMPT = "Say hello."
TRACE_PROMPTS = (
    "Write a detailed, multi-paragraph essay about the history of the printing press.",
    "Explain step by step, in depth, how the human immune system fights a viral infection.",
    "Write a long, detailed guide to growing tomatoes in a home garden, from seed to harvest.",
    "Describe in detail how steam engines work and why they mattered for industry.",
)


@dataclass(frozen=True)
class Seeded:
    chat_key: str
    chat_message_id: str
    auditor_key: str
    traced_users: list[tuple[int, str]]  # (user id, message id)
    registration_s: float


def _median_ci95(samples: list[float], resamples: int = 5000) -> list[float]:
    """Percentile-bootstrap 95 % interval of the median (seeded): how far the p50 can move by chance."""
    rng = np.random.default_rng(0)
    data = np.asarray(samples)
    medians = np.median(data[rng.integers(0, data.size, size=(resamples, data.size))], axis=1)
    return [round(float(q), 3) for q in np.percentile(medians, [2.5, 97.5])]


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(pick(0.99), 3),
        "mean": round(statistics.fmean(ordered), 3),
    }


async def _fresh_database(database_url: str) -> None:
    await create_database(database_url, replace=True)
    await asyncio.to_thread(upgrade_database, database_url)


async def _seed(settings: Settings, pepper: str, users: int, traced: int) -> Seeded:
    params = params_from_settings(settings)
    hasher = ApiKeyHasher(pepper.encode())
    engine = create_engine(settings)
    try:
        sessionmaker = create_sessionmaker(engine)
        async with session_scope(sessionmaker) as session:
            service = UserService(Repositories(session), params, hasher)
            chat = await service.create_user("bench-chat", "user")
            auditor = await service.create_user("bench-auditor", "auditor")
        started = time.perf_counter()
        async with session_scope(sessionmaker) as session:
            repo = UserRepository(session)
            allocator = MessageAllocator(await repo.all_message_ids(), params)
            rows = []
            for number in range(users):
                now_bits = allocator.allocate().bits
                rows.append(User(name=f"bench-user-{number}", role="user", status="active", message_id=now_bits))
            for row in rows:
                await repo.add(row)
            chosen = [(row.id, row.message_id) for row in rows[:: max(1, users // traced)][:traced]]
        registration_s = time.perf_counter() - started
    finally:
        await engine.dispose()
    return Seeded(chat.api_key, chat.message_id, auditor.api_key, chosen, registration_s)


def _gateway_settings(settings: Settings, secret_env: str, pepper: str) -> dict[str, str]:
    return {
        "XMARK_DATABASE_URL": settings.database_url,
        "XMARK_VAR_DIR": str(settings.var_dir),
        "XMARK_WATERMARK_SECRETS": secret_env,
        "XMARK_WATERMARK_SCHEME": settings.watermark_scheme,
        "XMARK_API_KEY_PEPPER": pepper,
        "XMARK_MODEL_PATH": str(settings.resolved_model_path()),
        "XMARK_MODEL_NAME": settings.model_name,
        "XMARK_LOG_LEVEL": settings.log_level,
        "XMARK_KEYRING_REFRESH_SECONDS": "0",
        "XMARK_RECORD_BEFORE_RESPONSE": str(settings.record_before_response).lower(),
        "XMARK_WORKERS": str(settings.workers),
        "XMARK_TRACE_SCORER_DTYPE": settings.trace_scorer_dtype,
        # one user sends every overhead sample back to back: far above the default requests per
        # minute, which would otherwise refuse them (the admission checks still run and are measured)
        "XMARK_USER_REQUESTS_PER_MINUTE": "1000000",
        "XMARK_USER_TOKENS_PER_MINUTE": "100000000",
    }


def _start_server(
    settings: Settings, secret_env: str, pepper: str, port: int, log_path: Path
) -> subprocess.Popen[bytes]:
    """The gateway as production runs it: ``xmark serve`` in a process of its own."""
    env = dict(os.environ)
    env.update(_gateway_settings(settings, secret_env, pepper))
    command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("ab") as log:  # the access log at INFO, as in production, kept off the terminal
        return subprocess.Popen(command, env=env, stdout=log, stderr=log)


NULLS_READY = "trace null distributions ready"


async def _start_and_wait(
    settings: Settings, secret_env: str, pepper: str, log_path: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """``xmark serve`` on a free port, once every worker has done its start-up work."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    prepared = _log_count(log_path, NULLS_READY)
    process = _start_server(settings, secret_env, pepper, port, log_path)
    await _wait_ready(base_url, process, log_path)
    await _wait_for_log(log_path, NULLS_READY, prepared + settings.workers)
    return process, base_url


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def _log_count(log_path: Path, message: str) -> int:
    return log_path.read_text(errors="replace").count(message) if log_path.exists() else 0


async def _wait_for_log(log_path: Path, message: str, count: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while _log_count(log_path, message) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not log {message!r}")
        await asyncio.sleep(0.25)


def _log_tail(log_path: Path, chars: int = 2000) -> str:
    return log_path.read_text(errors="replace")[-chars:] if log_path.exists() else ""


async def _wait_ready(
    base_url: str, process: subprocess.Popen[bytes] | None, log_path: Path, timeout: float = 300.0
) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                error = await asyncio.to_thread(_log_tail, log_path)
                raise RuntimeError(f"the gateway exited during start-up: {error}")
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError("the gateway did not become ready")


class _InFlight:
    """The gateway app, knowing when it has finished every request (work after a response included)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._count += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self._count -= 1
            if self._count == 0:
                self._idle.set()

    async def settled(self) -> None:
        await self._idle.wait()


@asynccontextmanager
async def _gateway_in_process(settings: Settings, port: int, log_path: Path) -> AsyncIterator[FastAPI]:
    """The gateway app served by uvicorn on this process's event loop."""
    secrets_ = load_secrets(settings)
    with log_path.open("a") as log:
        configure_logging(settings.log_level, secrets_.all_values(), stream=log)
        app = create_app(settings)
        app.state.bench_in_flight = in_flight = _InFlight(app)
        config = uvicorn.Config(
            in_flight, host="127.0.0.1", port=port, loop="none", log_config=None, access_log=False, lifespan="on"
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        try:
            await _wait_ready(f"http://127.0.0.1:{port}", None, log_path)
            if app.state.resources.trace_null_warmer is not None:  # measure after the start-up work, not during it
                await asyncio.wait_for(asyncio.shield(app.state.resources.trace_null_warmer), timeout=300)
            yield app
        finally:
            server.should_exit = True
            await task
            logging.getLogger().handlers.clear()


def _server_timing(values: list[str]) -> dict[str, float]:
    """``{name: dur}`` of Server-Timing header values such as ``model;dur=12.5, app;dur=14.1``."""
    timings: dict[str, float] = {}
    for value in values:
        for entry in value.split(","):
            name, _, params = entry.strip().partition(";")
            for param in params.split(";"):
                key, _, number = param.strip().partition("=")
                if key == "dur":
                    timings[name] = float(number)
    return timings


async def _overhead(
    base_url: str,
    backend: Backend,
    settled: Callable[[], Awaitable[None]],
    stamp: WatermarkStamp,
    api_key: str,
    model: str,
    requests: int,
    max_tokens: int,
) -> dict[str, Any]:
    """Triplets: the backend called directly, then the same request through the gateway with
    aiohttp (a client with a small cost of its own) and with httpx (the OpenAI SDK's client)."""
    messages = [{"role": "system", "content": OVERHEAD_SYSTEM}, {"role": "user", "content": OVERHEAD_PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    request = GenerationRequest(
        (ChatTurn("system", OVERHEAD_SYSTEM), ChatTurn("user", OVERHEAD_PROMPT)), max_tokens=max_tokens, temperature=0.0
    )
    samples: dict[str, list[float]] = {"direct": [], "aiohttp": [], "httpx": []}
    authenticated: list[float] = []
    tokens: set[tuple[int, ...]] = set()
    headers = {"Authorization": f"Bearer {api_key}"}
    async with (
        aiohttp.ClientSession(base_url=base_url, headers=headers) as lean,
        httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as sdk_client,
    ):
        model_in_gateway: list[float] = []  # the model's share of each aiohttp call (Server-Timing)

        async def via_aiohttp() -> dict[str, Any]:
            async with lean.post("/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                model_in_gateway.append(_server_timing(response.headers.getall("Server-Timing", []))["model"])
                return await response.json()  # type: ignore[no-any-return]

        async def via_httpx() -> dict[str, Any]:
            response = await sdk_client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()  # type: ignore[no-any-return]

        for index in range(requests + 5):
            await settled()  # the previous calls' work after their responses is not the direct call's
            started = time.perf_counter()
            result = await backend.generate(request, stamp)
            timings = {"direct": (time.perf_counter() - started) * 1000}
            counts = [result.completion_tokens]
            for name, call in (("aiohttp", via_aiohttp), ("httpx", via_httpx)):
                await settled()
                started = time.perf_counter()
                data = await call()
                timings[name] = (time.perf_counter() - started) * 1000
                counts.append(data["usage"]["completion_tokens"])
            tokens.add(tuple(counts))
            if index >= 5:  # warm-up excluded
                for name, value in timings.items():
                    samples[name].append(value)
        # the authenticated request path alone (no model, no write), for a breakdown of the overhead
        for index in range(requests + 5):
            started = time.perf_counter()
            async with lean.get("/v1/models") as response:
                response.raise_for_status()
                await response.read()
            if index >= 5:
                authenticated.append((time.perf_counter() - started) * 1000)
    direct = samples["direct"]
    # Paired differences (each gateway call right after its direct twin) cancel most of the
    # drift in model time, which on a shared CPU is far larger than the gateway's own cost.
    differences = {name: [g - d for g, d in zip(samples[name], direct, strict=True)] for name in ("aiohttp", "httpx")}
    paired: dict[str, dict[str, Any]] = {name: _percentiles(values) for name, values in differences.items()}
    for name, values in differences.items():
        # the model step's own run-to-run spread dominates a single p50: its 95 % interval
        paired[name]["p50_ci95"] = _median_ci95(values)
    # Each aiohttp call minus the model time the gateway reports for that very call: no model
    # step's spread is left in it. Its mean should agree with the paired differences' mean (a
    # model step slowed down by the gateway would show as a gap between the two).
    per_request = [g - m for g, m in zip(samples["aiohttp"], model_in_gateway[5:], strict=True)]
    paired["per_request"] = _percentiles(per_request)
    paired["per_request"]["p50_ci95"] = _median_ci95(per_request)
    return {
        "requests": requests,
        "max_tokens": max_tokens,
        "completion_tokens_direct_aiohttp_httpx": sorted(tokens),
        "direct_ms": _percentiles(direct),
        "gateway_ms": _percentiles(samples["aiohttp"]),
        "overhead_ms": paired["aiohttp"],
        "overhead_per_request_ms": paired["per_request"],
        "gateway_with_httpx_ms": _percentiles(samples["httpx"]),
        "overhead_with_httpx_ms": paired["httpx"],
        "authenticated_get_models_ms": _percentiles(authenticated),
        "target_p50_ms": 3.0,
        "meets_target": paired["aiohttp"]["p50"] <= 3.0,
    }


async def _overhead_per_request(
    base_url: str, api_key: str, model: str, requests: int, max_tokens: int
) -> dict[str, Any]:
    """Round trip minus the model time the gateway reports for the same request (Server-Timing),
    and the part of it spent inside the app before the response starts (``app`` minus ``model``)."""
    messages = [{"role": "system", "content": OVERHEAD_SYSTEM}, {"role": "user", "content": OVERHEAD_PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    overhead: list[float] = []
    in_app: list[float] = []
    model_ms: list[float] = []
    async with aiohttp.ClientSession(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}) as client:
        for index in range(requests + 5):
            started = time.perf_counter()
            async with client.post("/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                await response.json()
                timings = _server_timing(response.headers.getall("Server-Timing", []))
            elapsed = (time.perf_counter() - started) * 1000
            if not {"model", "app"} <= timings.keys():
                raise RuntimeError(f"the gateway sent no model and app Server-Timing: {timings}")
            if index >= 5:  # warm-up excluded
                overhead.append(elapsed - timings["model"])
                in_app.append(timings["app"] - timings["model"])
                model_ms.append(timings["model"])
    result: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens, "model_ms": _percentiles(model_ms)}
    result["overhead_ms"] = _percentiles(overhead)
    result["overhead_ms"]["p50_ci95"] = _median_ci95(overhead)
    # of which inside the app (routing, auth, validation, serialisation); the rest is HTTP and the client
    result["in_app_ms"] = _percentiles(in_app)
    result.update(target_p50_ms=3.0, meets_target=result["overhead_ms"]["p50"] <= 3.0)
    return result


async def _trace_texts(backend: Backend, key: WatermarkKey, users: list[tuple[int, str]], tokens: int) -> list[str]:
    """One watermarked text of ``tokens`` tokens per user: an answer the model ended early (at its
    end-of-text token) is drawn again with another seed, so every run traces full-length texts."""

    async def one(index: int, message_id: str) -> str:
        stamp = WatermarkStamp(key, Message.from_bits(message_id, key.params))
        longest = ("", -1)
        for attempt in range(8):
            request = GenerationRequest(
                (ChatTurn("user", TRACE_PROMPTS[index % len(TRACE_PROMPTS)]),),
                max_tokens=tokens,
                temperature=0.8,
                seed=1000 * index + attempt,
            )
            choice = (await backend.generate(request, stamp)).choices[0]
            if choice.completion_tokens >= tokens:
                return choice.text
            longest = max(longest, (choice.text, choice.completion_tokens), key=lambda pair: pair[1])
        return longest[0]

    return list(await asyncio.gather(*(one(i, m) for i, (_, m) in enumerate(users))))


async def _trace_load(
    base_url: str,
    api_key: str,
    texts: list[str],
    owners: list[int],
    concurrency: int,
    seconds: float,
    *,
    decoder: str = "counting",
    target_rps: float = 200,
) -> dict[str, Any]:
    latencies: list[float] = []
    outcomes = {"correct": 0, "wrong": 0, "unattributed": 0, "errors": 0}
    # the same text always gets the same report: one verdict per text, for a wrong or missing name
    per_text: list[dict[str, Any]] = [{"owner": owner, "traces": 0} for owner in owners]
    # aiohttp: the load generator's own CPU shares the machine with the gateway, so a lean client
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, connector=connector
    ) as client:

        async def post(text: str) -> tuple[int, dict[str, Any] | None]:
            async with client.post("/trace", json={"text": text, "decoder": decoder}) as response:
                return response.status, (await response.json() if response.status == 200 else None)

        for index in range(2 * len(texts)):  # warm-up: registry snapshot, connections
            await post(texts[index % len(texts)])
        deadline = time.perf_counter() + seconds

        async def worker(offset: int) -> None:
            index = offset
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                _status, report = await post(texts[index % len(texts)])
                latencies.append((time.perf_counter() - started) * 1000)
                detail = per_text[index % len(texts)]
                detail["traces"] += 1
                if report is None:
                    outcomes["errors"] += 1
                else:
                    attribution = report["attribution"]
                    if attribution is None:
                        outcomes["unattributed"] += 1
                    elif attribution["user_id"] == owners[index % len(texts)]:
                        outcomes["correct"] += 1
                    else:
                        outcomes["wrong"] += 1
                    detail.update(
                        named=None if attribution is None else attribution["user_id"],
                        confidence=None if attribution is None else attribution["confidence"],
                        p_value=report["p_value"],
                        top_candidates=[(c["user_id"], c["hamming"]) for c in report["candidates"][:3]],
                    )
                index += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    done = len(latencies)
    return {
        "decoder": decoder,
        "concurrency": concurrency,
        "duration_s": round(elapsed, 2),
        "requests": done,
        "throughput_rps": round(done / elapsed, 1),
        "latency_ms": _percentiles(latencies),
        "outcomes": outcomes,
        "per_text": per_text,
        "target_rps": target_rps,
        "meets_target": done / elapsed >= target_rps,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    secret = secrets.token_urlsafe(32)
    pepper = secrets.token_urlsafe(32)
    secret_env = f"bench1:{secret}"
    with tempfile.TemporaryDirectory(prefix="xmark-bench-") as var_dir:
        settings = Settings(
            # greedy answers (temperature 0, the same in every arm) need the biasing scheme: the
            # distortion-free default refuses them
            watermark_scheme="xmark",
            database_url=args.database_url,
            var_dir=Path(var_dir),
            watermark_secrets=SecretStr(secret_env),
            api_key_pepper=SecretStr(pepper),
            model_path=args.model_path.resolve(),
            log_level=args.log_level,
            keyring_refresh_seconds=0,
            record_before_response=args.record_before_response,
            workers=args.workers or len(os.sched_getaffinity(0)),
        )
        log_path = Path(var_dir) / "gateway.log"
        await _fresh_database(settings.database_url)
        process: subprocess.Popen[bytes] | None = None
        try:
            seeded = await _seed(settings, pepper, args.users, args.traced_users)
            port = free_port()
            async with _gateway_in_process(settings, port, log_path) as app:
                backend = app.state.resources.backend
                handle = app.state.resources.keyring.active()
                stamp = WatermarkStamp(
                    handle.key, Message.from_bits(seeded.chat_message_id, handle.key.params), handle.name
                )
                overhead = await _overhead(
                    f"http://127.0.0.1:{port}",
                    backend,
                    app.state.bench_in_flight.settled,
                    stamp,
                    seeded.chat_key,
                    settings.model_name,
                    args.requests,
                    args.max_tokens,
                )
                texts = await _trace_texts(backend, handle.key, seeded.traced_users, args.trace_tokens)
                short_texts = await _trace_texts(backend, handle.key, seeded.traced_users, args.short_trace_tokens)
                tokenizer = backend.tokenizer
                text_tokens = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
                short_tokens = [len(tokenizer.encode(t, add_special_tokens=False)) for t in short_texts]
            owners = [user_id for user_id, _ in seeded.traced_users]
            process, base_url = await _start_and_wait(settings, secret_env, pepper, log_path)
            per_request = await _overhead_per_request(
                base_url, seeded.chat_key, settings.model_name, args.requests, args.max_tokens
            )
            trace = await _trace_load(base_url, seeded.auditor_key, texts, owners, args.concurrency, args.seconds)
            trace.update({"registered_users": args.users + 2, "text_tokens": text_tokens, "workers": settings.workers})

            async def likelihood_load(url: str, chosen: list[str], lengths: list[int]) -> dict[str, Any]:
                load = await _trace_load(
                    url,
                    seeded.auditor_key,
                    chosen,
                    owners,
                    args.likelihood_concurrency,
                    args.seconds,
                    decoder="likelihood",
                    target_rps=10,
                )
                load["text_tokens"] = lengths
                return load

            likelihood = {}
            for label, chosen, lengths in (("short", short_texts, short_tokens), ("long", texts, text_tokens)):
                likelihood[label] = await likelihood_load(base_url, chosen, lengths)
            scorer_dtype = str(resolve_scorer_dtype(settings.trace_scorer_dtype)).removeprefix("torch.")
            likelihood["scorer_dtype"] = scorer_dtype
            if scorer_dtype != "float32":  # the same short load with a float32 forward pass
                _stop(process)
                exact = settings.model_copy(update={"trace_scorer_dtype": "float32"})
                process, base_url = await _start_and_wait(exact, secret_env, pepper, log_path)
                baseline = await likelihood_load(base_url, short_texts, short_tokens)
                likelihood["short_float32"] = baseline
                likelihood["short_speedup_vs_float32"] = round(
                    likelihood["short"]["throughput_rps"] / baseline["throughput_rps"], 2
                )
            if settings.workers > 1:  # the same load on one worker: what the extra processes bring
                _stop(process)
                single = settings.model_copy(update={"workers": 1})
                process, base_url = await _start_and_wait(single, secret_env, pepper, log_path)
                one = await _trace_load(base_url, seeded.auditor_key, texts, owners, args.concurrency, args.seconds)
                trace["one_worker"] = {
                    key: one[key] for key in ("requests", "throughput_rps", "latency_ms", "outcomes", "meets_target")
                }
                trace["speedup_vs_one_worker"] = round(trace["throughput_rps"] / one["throughput_rps"], 2)
        finally:
            if process is not None:
                _stop(process)
            if not args.keep_database:
                await drop_database(settings.database_url)
            log_lines = len(log_path.read_text(errors="replace").splitlines()) if log_path.exists() else 0
    return {
        "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_at_start": load_at_start,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "registration": {"users": args.users, "seconds": round(seeded.registration_s, 2)},
        "gateway_log": {"level": args.log_level, "lines": log_lines},
        "gateway_workers": settings.workers,
        "record_before_response": settings.record_before_response,
        "gateway_overhead": overhead,
        "gateway_overhead_per_request": per_request,
        "trace": trace,
        "trace_likelihood": likelihood,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: indented JSON)")
    parser.add_argument(
        "--database-url",
        default="postgresql+asyncpg://root@127.0.0.1:5432/xmark_bench",
        help="database to create, use and drop (default: %(default)s)",
    )
    parser.add_argument(
        "--model-path",
        type=Path,
        default=Path("var/models/smollm2-135m-instruct"),
        help="model checkpoint, as built by `xmark fetch-model` (default: %(default)s)",
    )
    parser.add_argument("--users", type=int, default=10_000, help="registered users (default: %(default)s)")
    parser.add_argument("--traced-users", type=int, default=4, help="users whose texts are traced")
    parser.add_argument("--requests", type=int, default=200, help="overhead samples per path")
    parser.add_argument("--max-tokens", type=int, default=1, help="completion tokens per overhead request")
    parser.add_argument("--trace-tokens", type=int, default=300, help="tokens per traced text")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent /trace clients")
    parser.add_argument(
        "--short-trace-tokens", type=int, default=150, help="tokens per text of the likelihood decoder's short load"
    )
    parser.add_argument(
        "--likelihood-concurrency", type=int, default=4, help="concurrent /trace clients with the likelihood decoder"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of the /trace load")
    parser.add_argument(
        "--log-level", default="INFO", help="the gateways' log level; INFO, the default, logs every request"
    )
    parser.add_argument(
        "--record-before-response",
        action="store_true",
        help="run the gateways with XMARK_RECORD_BEFORE_RESPONSE=true (a completion waits for its record)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes of the `xmark serve` gateway (default: one per CPU of this machine)",
    )
    parser.add_argument("--keep-database", action="store_true", help="do not drop the database afterwards")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The gateway runs on uvloop (uvicorn picks it when installed); so does this process, so that
    # the direct calls' thread hand-offs cost what the gateway's do.
    result = uvloop.run(run(args)) if uvloop is not None else asyncio.run(run(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
