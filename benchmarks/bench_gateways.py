"""Gateways side by side: direct to the upstream vs xmark-gateway vs LiteLLM's proxy, one run.

    python -m benchmarks.bench_gateways            # make bench-gateways
    python -m benchmarks.bench_gateways --upstreams fake --seconds 5 --rounds 2

Targets, each in processes of its own on this machine:

* ``direct``: the load generator straight to the upstream (the floor every gateway adds to);
* ``xmark``: ``xmark serve`` as deployed in front of vLLM (``XMARK_BACKEND=vllm``), PostgreSQL for its
  users and records (a dedicated database, created and dropped here), API-key auth, admission,
  the watermark stamp and a generation record (with its content sketch) for every completion;
* ``xmark_messages`` (fake upstream): the same ``xmark serve`` process through ``POST /v1/messages``
  (Anthropic's Messages API, the key as ``x-api-key``), the same one-line prompt, ``max_tokens``
  and temperature in Anthropic's shape, which the gateway turns into the same chat request upstream;
* ``litellm``: LiteLLM's proxy (its own virtualenv, ``make venv-litellm``, pinned with hashes),
  master key only, no database;
* ``litellm_db``: LiteLLM's production mode (virtual keys and spend logs in the same PostgreSQL),
  where its database client can run here (see benchmarks/litellm/README.md): otherwise its entry
  says why not.

Upstreams: ``fake`` (``benchmarks.fake_upstream``: a prepared 16-token answer, streamed or not, in
microseconds) and ``vllm`` (the real CPU ``vllm serve`` worker with the XMark logits processor; the
direct requests carry the same watermark arguments the gateway adds, so the worker does the same
work either way). The load generator (``benchmarks.loadgen``) keeps ``concurrency`` connections busy
for ``--seconds`` per cell after a warm-up; cells run for concurrency 1, 16, 64 and 256,
non-streamed and streamed, with one gateway process and with one per core, and each round visits
the targets in a rotated order (rounds interleaved).

Per cell and target: latency p50/p95/p99 over the pooled rounds, the added p50/p95/p99 over direct in
the same cell, requests/s (the rounds' median, and their range as the interval), the target's CPU
seconds per 1,000 requests (user + system time of its whole process tree, over every answer of the
cell, warm-up included), its RSS, a stream's time to first byte and per-chunk time, and every
non-2xx answer by status. The vLLM cells add tokens/s and the gateway's tokens/s over direct.
Where a cell has both routes, ``messages_vs_chat`` holds the ratios /v1/messages over chat of the
gateway's added p50 and of its CPU per request: the pooled figures' ratio and, as the interval,
the range of the rounds' own ratios (round r of each route against direct's round r).

``--vllm-cores 0`` gives the vLLM worker's forward pass cores of its own, as a GPU worker has its own
accelerator: vLLM binds its compute threads to the listed cores (``VLLM_CPU_OMP_THREADS_BIND``), and
every other process of the vLLM cells (this one, the load generator, the gateways, vLLM's own API
server and scheduler, and a PostgreSQL server of the run's own, started for them, as the shared
server's processes cannot be moved) runs on the remaining cores, the host's CPU of a GPU
deployment. Without it, vLLM binds its compute thread to one core but everything else floats over
both, and whatever lands on that core during a decoding step stalls the step.

The last line is one JSON object: ``results`` (one object per upstream, concurrency, stream,
processes), ``litellm_version``, the machine and the settings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.launch import MODEL_NAME, free_port, vllm_serve_command
from benchmarks.litellm_proxy import LITELLM_PYTHON, LitellmProxy, litellm_version, start_litellm
from benchmarks.pg_admin import create_database, drop_database
from benchmarks.pg_server import PrivatePostgres
from benchmarks.vllm_overhead import stop_server, wait_healthy
from service.db import upgrade_database

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = REPO / "var" / "models" / MODEL_NAME
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
KEY_VERSION = "bench"
PROMPT = "Say hello."  # the fake upstream answers its prepared tokens whatever the prompt
# vLLM: a prompt answered past VLLM_TOKENS on every path, so each answer is VLLM_TOKENS long through
# direct, xmark-gateway and LiteLLM alike ("Say hello." ended after 7 watermarked tokens, and after 30
# unwatermarked ones through LiteLLM, which adds no watermark): tokens/s compares equal work
VLLM_PROMPT = "Write a long story about a lighthouse keeper and the ships she watched."
FAKE_TOKENS = 16
VLLM_TOKENS = 32
START_TIMEOUT_S = 300.0
TARGETS = ("direct", "xmark", "xmark_messages", "litellm", "litellm_db")
# the PostgreSQL server both gateways' databases are created on (``XMARK_BENCH_POSTGRES`` to change)
DEFAULT_POSTGRES = "postgresql+asyncpg://root@127.0.0.1:5432"
# the run's database: this prefix and a random suffix (``--database-prefix`` to change)
DATABASE_PREFIX = "xmark_gateways_"
ANTHROPIC_VERSION = "2023-06-01"


@dataclass
class Target:
    """A running target: where the load goes, with which headers, and whose CPU is counted."""

    name: str
    url: str
    headers: list[str]
    pids: list[int]
    body_extra: dict[str, Any] = field(default_factory=dict)
    api: str = "chat"  # the body's shape: "chat" (OpenAI's chat completions) or "messages" (Anthropic's)

    def tree(self) -> list[psutil.Process]:
        processes: list[psutil.Process] = []
        for pid in self.pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(pid)
                processes += [root, *root.children(recursive=True)]
        return processes

    def cpu_s(self) -> float:
        total = 0.0
        for process in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                total += times.user + times.system
        return total

    def rss_mb(self) -> float:
        total = 0
        for process in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += process.memory_info().rss
        return total / 2**20


# -- the processes ---------------------------------------------------------------------------------

# What each gateway process logs once its start-up work is done (``service.resources``): the trace
# null distributions simulated on a worker thread and the start-up heap frozen. /readyz answers
# before that (chat is served meanwhile), but the simulation takes seconds of CPU that would land
# in the first cell's figures, and on the vLLM worker's cores.
START_UP_DONE = "start-up heap frozen"


async def wait_start_up(
    log: Path, processes: int, process: subprocess.Popen[bytes], timeout: float = START_TIMEOUT_S
) -> None:
    """Wait until ``processes`` gateway processes have logged the end of their start-up work."""
    deadline = time.monotonic() + timeout
    while True:
        lines = (await asyncio.to_thread(log.read_text, errors="replace")).splitlines()
        if sum(START_UP_DONE in line for line in lines) >= processes:
            return
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited during start-up:\n{chr(10).join(lines[-20:])}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway's {processes} processes did not finish start-up in {timeout:.0f} s")
        await asyncio.sleep(0.25)


def _popen(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


async def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = await asyncio.to_thread(log.read_text, errors="replace")
                raise RuntimeError(f"{url} exited during start-up:\n{tail[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready in {timeout:.0f} s")


@dataclass
class Xmark:
    """``xmark serve`` in front of one upstream, with its own database and one user."""

    database_url: str
    env: dict[str, str]
    api_key: str
    message_bits: str
    process: subprocess.Popen[bytes] | None = None
    port: int = 0

    @classmethod
    async def prepare(cls, upstream_url: str, workdir: Path, postgres: str, prefix: str = DATABASE_PREFIX) -> Xmark:
        database_url = f"{postgres}/{prefix}{secrets.token_hex(4)}"
        await create_database(database_url)
        await asyncio.to_thread(upgrade_database, database_url)
        env = {
            **os.environ,
            "XMARK_DATABASE_URL": database_url,
            "XMARK_VAR_DIR": str(workdir / "xmark-var"),
            "XMARK_WATERMARK_SECRETS": f"{KEY_VERSION}:{secrets.token_hex(32)}",
            "XMARK_API_KEY_PEPPER": secrets.token_hex(32),
            "XMARK_BACKEND": "vllm",
            "XMARK_VLLM_URLS": upstream_url,
            "XMARK_MODEL_PATH": str(CHECKPOINT),
            "XMARK_MODEL_NAME": MODEL_NAME,
            "XMARK_VLLM_TIMEOUT_S": "600",
            # the requests are greedy (temperature 0), which the distortion-free default refuses; the
            # fake upstream does not sample, so the scheme changes nothing else here
            "XMARK_WATERMARK_SCHEME": "xmark",
            # one user sends every request: far above the default limits (the checks still run)
            "XMARK_USER_MAX_PARALLEL_REQUESTS": "100000",
            "XMARK_USER_REQUESTS_PER_MINUTE": "100000000",
            "XMARK_USER_TOKENS_PER_MINUTE": "1000000000",
            "XMARK_MAX_QUEUED_REQUESTS": "100000",
        }
        env.pop("XMARK_SECRETS_FILE", None)
        created = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "service.cli", "create-user", "bench", "--json"],
            env=env,
            capture_output=True,
            check=True,
        )
        user = json.loads(created.stdout)
        return cls(database_url, env, user["api_key"], user["message_id"])

    async def start(self, workers: int, log: Path) -> Target:
        self.port = free_port()
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--workers", str(workers)]
        self.process = _popen(command, self.env, log)
        await _wait_http(f"http://127.0.0.1:{self.port}/readyz", self.process, log)
        await wait_start_up(log, workers, self.process)
        return Target(
            "xmark",
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            [f"authorization: Bearer {self.api_key}"],
            [self.process.pid],
        )

    def messages_target(self) -> Target:
        """The running gateway through ``POST /v1/messages``, keyed as Anthropic's clients key it."""
        assert self.process is not None
        return Target(
            "xmark_messages",
            f"http://127.0.0.1:{self.port}/v1/messages",
            [f"x-api-key: {self.api_key}", f"anthropic-version: {ANTHROPIC_VERSION}"],
            [self.process.pid],
            api="messages",
        )

    def stop(self) -> None:
        if self.process is not None:
            stop_server(self.process)
            self.process = None

    async def drop(self) -> None:
        await drop_database(self.database_url)


class Upstream:
    """The fake server or a CPU vLLM worker."""

    def __init__(self, kind: str, workdir: Path, max_num_seqs: int, cores: list[int] | None = None) -> None:
        self.kind = kind
        self.port = free_port()
        self.log = workdir / f"upstream-{kind}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        if kind == "fake":
            command = [sys.executable, "-m", "benchmarks.fake_upstream", "--port", str(self.port)]
            command += ["--tokens", str(FAKE_TOKENS)]
        else:
            env["XMARK_WATERMARK_SECRETS"] = "unset"  # replaced in start() once the gateway's key is known
            # the XMark op is built with the venv's own tools; a small KV cache fits beside everything else
            env["PATH"] = f"{VLLM_PYTHON.parent}:{env.get('PATH', '')}"
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            command = vllm_serve_command(CHECKPOINT, self.port, max_num_seqs=max_num_seqs)
            command[0] = str(VLLM_PYTHON)
            if cores:  # the forward pass's threads, bound by vLLM itself; its other processes stay beside the gateway
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        self.command = command
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, watermark_secrets: str | None = None) -> None:
        if watermark_secrets is not None:
            self.env["XMARK_WATERMARK_SECRETS"] = watermark_secrets
        self.process = _popen(self.command, self.env, self.log)
        if self.kind == "fake":
            await _wait_http(f"{self.base_url}/health", self.process, self.log)
        else:
            try:
                await wait_healthy(self.base_url, self.process, START_TIMEOUT_S)
            except (RuntimeError, TimeoutError) as exc:
                tail = await asyncio.to_thread(self.log.read_text, errors="replace")
                raise RuntimeError(f"the vLLM worker: {exc}\n{tail[-3000:]}") from None

    def stop(self) -> None:
        if self.process is not None:
            stop_server(self.process)
            self.process = None


# -- the load --------------------------------------------------------------------------------------


def _body(stream: bool, max_tokens: int, extra: dict[str, Any], prompt: str = PROMPT, api: str = "chat") -> str:
    """The request of a cell: the same prompt, ``max_tokens`` and temperature in either API's shape."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if stream and api == "chat":  # a Messages stream always ends with its usage (message_delta)
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body)


async def _load(
    target: Target, concurrency: int, stream: bool, seconds: float, warmup: float, max_tokens: int, tokens: bool
) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", target.url]
    command += ["--body", _body(stream, max_tokens, target.body_extra, VLLM_PROMPT if tokens else PROMPT, target.api)]
    for header in target.headers:
        command += ["--header", header]
    command += ["--concurrency", str(concurrency), "--seconds", str(seconds), "--warmup", str(warmup)]
    if tokens:
        command.append("--count-tokens")
    cpu_before = target.cpu_s()
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, check=False)
    cpu_after = target.cpu_s()
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed: {done.stderr.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    result["cpu_s"] = cpu_after - cpu_before
    result["rss_mb"] = target.rss_mb()
    return result


def _combine(rounds: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """One target's cell over its rounds: percentiles of the rounds' p50s etc. pooled by median,
    rps as the rounds' median with their range, CPU over every answer of every round."""

    def med(key: str, sub: str) -> float:
        return float(statistics.median(r[key][sub] for r in rounds))

    rps = [r["rps"] for r in rounds]
    answered = sum(r["answered"] for r in rounds)
    cpu = sum(r["cpu_s"] for r in rounds)
    errors: dict[str, int] = {}
    for r in rounds:
        for status, count in r["errors"].items():
            errors[status] = errors.get(status, 0) + count
        if r["transport_errors"]:
            errors["transport"] = errors.get("transport", 0) + r["transport_errors"]
    combined: dict[str, Any] = {
        "p50_ms": med("latency_ms", "p50"),
        "p95_ms": med("latency_ms", "p95"),
        "p99_ms": med("latency_ms", "p99"),
        "rps": float(statistics.median(rps)),
        "rps_range": [min(rps), max(rps)],
        "cpu_s_per_1000": 1000 * cpu / answered if answered else None,
        "rss_mb": max(r["rss_mb"] for r in rounds),
        "ttfb_p50_ms": med("ttfb_ms", "p50"),
        "per_chunk_ms": statistics.median(r["per_event_ms"] for r in rounds) if rounds[0]["per_event_ms"] else None,
        "requests": sum(r["requests"] for r in rounds),
        "errors": errors,
        "p50_ms_rounds": [r["latency_ms"]["p50"] for r in rounds],
        "cpu_s_per_1000_rounds": [1000 * r["cpu_s"] / r["answered"] if r["answered"] else None for r in rounds],
    }
    if any(r["tokens"] for r in rounds):
        # tokens over the time the connections were busy with measured requests (a closed loop of
        # requests of half a second: counting whole requests in a fixed span would be off by one)
        per_round = [r["tokens"] * concurrency / r["busy_s"] for r in rounds if r["busy_s"]]
        combined["tokens_per_s"] = sum(r["tokens"] for r in rounds) * concurrency / sum(r["busy_s"] for r in rounds)
        combined["tokens_per_s_rounds"] = per_round
        combined["tokens"] = sum(r["tokens"] for r in rounds)
    return combined


def _rotations(names: list[str], rounds: int) -> Iterator[list[str]]:
    for r in range(rounds):
        k = r % len(names)
        yield names[k:] + names[:k]


async def _cells(
    upstream: str,
    targets: dict[str, Target],
    processes: int,
    args: argparse.Namespace,
    concurrencies: list[int],
    max_tokens: int,
    seconds: float,
) -> list[dict[str, Any]]:
    results = []
    for concurrency in concurrencies:
        for stream in (False, True):
            per_target: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            for order in _rotations(list(targets), args.rounds):
                for name in order:
                    outcome = await _load(
                        targets[name], concurrency, stream, seconds, args.warmup, max_tokens, upstream == "vllm"
                    )
                    per_target[name].append(outcome)
            cell: dict[str, Any] = {
                "upstream": upstream,
                "concurrency": concurrency,
                "stream": stream,
                "processes": processes,
                "errors": {},
            }
            for name, rounds in per_target.items():
                cell[name] = _combine(rounds, concurrency)
                cell["errors"][name] = sum(cell[name]["errors"].values())
            direct = cell.get("direct")
            for name in targets:
                if name != "direct" and direct is not None:
                    for q in ("p50", "p95", "p99"):
                        cell[name][f"added_{q}_ms"] = cell[name][f"{q}_ms"] - direct[f"{q}_ms"]
                    cell[name]["added_p50_ms_rounds"] = [
                        mine - floor
                        for mine, floor in zip(cell[name]["p50_ms_rounds"], direct["p50_ms_rounds"], strict=True)
                    ]
                    if "tokens_per_s" in cell[name] and direct.get("tokens_per_s"):
                        cell[name]["tokens_per_s_vs_direct"] = cell[name]["tokens_per_s"] / direct["tokens_per_s"]
            if "xmark" in cell and "xmark_messages" in cell and direct is not None:
                cell["messages_vs_chat"] = messages_vs_chat(cell["xmark"], cell["xmark_messages"])
            print(_row(cell), flush=True)
            if "messages_vs_chat" in cell:
                print(_ratio_row(cell["messages_vs_chat"]), flush=True)
            results.append(cell)
    return results


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine is not None and theirs else None


def messages_vs_chat(chat: dict[str, Any], messages: dict[str, Any]) -> dict[str, Any]:
    """/v1/messages over chat completions in one cell: the ratios of the gateway's added p50 and of
    its CPU per request, pooled, with the range of the rounds' own ratios as the interval."""
    ratios: dict[str, Any] = {}
    for key, rounds in (("added_p50", "added_p50_ms_rounds"), ("cpu_per_request", "cpu_s_per_1000_rounds")):
        pooled = "added_p50_ms" if key == "added_p50" else "cpu_s_per_1000"
        per_round = [_ratio(m, c) for m, c in zip(messages[rounds], chat[rounds], strict=True)]
        known = [r for r in per_round if r is not None]
        ratios[key] = {
            "ratio": _ratio(messages[pooled], chat[pooled]),
            "range": [min(known), max(known)] if known else None,
            "rounds": per_round,
        }
    return ratios


def _ratio_row(ratios: dict[str, Any]) -> str:
    parts = []
    for key, label in (("added_p50", "added p50"), ("cpu_per_request", "CPU per request")):
        entry = ratios[key]
        if entry["ratio"] is None:
            parts.append(f"{label} n/a")
            continue
        low, high = entry["range"]
        parts.append(f"{label} {entry['ratio']:.3f} (rounds {low:.3f}–{high:.3f})")
    return f"{'':<20}   messages / chat: " + ", ".join(parts)


def _cell_name(cell: dict[str, Any]) -> str:
    return f"{cell['upstream']}/c{cell['concurrency']}/{'stream' if cell['stream'] else 'plain'}/p{cell['processes']}"


def _row(cell: dict[str, Any]) -> str:
    head = f"{_cell_name(cell):<20}"
    parts = [head]
    for name in TARGETS:
        entry = cell.get(name)
        if not isinstance(entry, dict) or "p50_ms" not in entry:
            continue
        cpu = entry["cpu_s_per_1000"]
        text = f"{name}: p50 {entry['p50_ms']:.2f} p99 {entry['p99_ms']:.2f} ms, {entry['rps']:.0f} rps"
        text += f", cpu {cpu:.2f} s/1k" if cpu is not None else ""
        if "tokens_per_s" in entry:
            text += f", {entry['tokens_per_s']:.0f} tok/s"
        if entry["errors"]:
            text += f", errors {entry['errors']}"
        parts.append(text)
    return " | ".join(parts)


# -- the runs --------------------------------------------------------------------------------------


async def _litellm(
    mode: str, upstream: Upstream, workers: int, workdir: Path, database_url: str
) -> tuple[LitellmProxy | None, str | None]:
    try:
        proxy = await asyncio.to_thread(
            start_litellm,
            upstream_base_url=f"{upstream.base_url}/v1",
            model=MODEL_NAME,
            port=free_port(),
            workdir=workdir / f"litellm-{mode}-{workers}",
            mode=mode,  # type: ignore[arg-type]
            database_url=database_url if mode == "db" else None,
            workers=workers,
        )
    except RuntimeError as exc:
        return None, " ".join(str(exc).split())
    return proxy, None


def _litellm_target(name: str, proxy: LitellmProxy) -> Target:
    return Target(
        name, f"{proxy.base_url}/v1/chat/completions", [f"authorization: Bearer {proxy.api_key}"], [proxy.process.pid]
    )


async def run_upstream(
    kind: str, args: argparse.Namespace, workdir: Path
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every cell of one upstream; the second value: targets that could not run, and why."""
    concurrencies = args.concurrency if kind == "fake" else args.vllm_concurrency
    seconds = args.seconds if kind == "fake" else args.vllm_seconds
    worker_cores = args.vllm_cores if kind == "vllm" else None
    upstream = Upstream(kind, workdir, max_num_seqs=max(concurrencies), cores=worker_cores)
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as pinned:  # the private server stops after the gateway's database is dropped
        postgres = os.environ.get("XMARK_BENCH_POSTGRES", DEFAULT_POSTGRES)
        if worker_cores:
            postgres = await asyncio.to_thread(_pin_beside_worker, worker_cores, pinned)
        results = await _run_targets(kind, upstream, args, workdir, postgres, concurrencies, seconds, skipped)
    return results, skipped


def _pin_beside_worker(worker_cores: list[int], stack: contextlib.ExitStack) -> str:
    """Move this process (and so every process it starts: the load generator, the gateways, vLLM's
    processes but for the compute threads vLLM binds, PostgreSQL) off the worker's cores until
    ``stack`` closes; start a PostgreSQL server of its own there; its base URL."""
    before = os.sched_getaffinity(0)
    rest = before - set(worker_cores)
    os.sched_setaffinity(0, rest)
    stack.callback(os.sched_setaffinity, 0, before)
    server = PrivatePostgres()
    stack.callback(server.close)
    server.init()
    return f"postgresql+asyncpg://xmark@127.0.0.1:{server.port}"


async def _run_targets(
    kind: str,
    upstream: Upstream,
    args: argparse.Namespace,
    workdir: Path,
    postgres: str,
    concurrencies: list[int],
    seconds: float,
    skipped: dict[str, str],
) -> list[dict[str, Any]]:
    xmark: Xmark | None = None
    results: list[dict[str, Any]] = []
    try:
        xmark = await Xmark.prepare(upstream.base_url, workdir, postgres, args.database_prefix)
        await upstream.start(xmark.env["XMARK_WATERMARK_SECRETS"])
        direct = Target("direct", f"{upstream.base_url}/v1/chat/completions", [], [upstream.process.pid])  # type: ignore[union-attr]
        if kind == "vllm":  # the worker does the watermark's work for direct requests too
            direct.body_extra = {"vllm_xargs": {"xmark_message": xmark.message_bits, "xmark_key_version": KEY_VERSION}}
        for processes in args.processes if kind == "fake" else args.vllm_processes:
            targets = {"direct": direct}
            proxies: list[LitellmProxy] = []
            try:
                targets["xmark"] = await xmark.start(processes, workdir / f"xmark-{kind}-{processes}.log")
                if kind == "fake" and args.messages:  # the same process through /v1/messages
                    targets["xmark_messages"] = xmark.messages_target()
                for mode, name in (("master_key", "litellm"), ("db", "litellm_db")):
                    if not args.litellm:
                        break
                    proxy, why = await _litellm(mode, upstream, processes, workdir, xmark.database_url)
                    if proxy is None:
                        skipped[name] = why or "did not start"
                        continue
                    proxies.append(proxy)
                    targets[name] = _litellm_target(name, proxy)
                max_tokens = FAKE_TOKENS if kind == "fake" else VLLM_TOKENS
                results += await _cells(kind, targets, processes, args, concurrencies, max_tokens, seconds)
            finally:
                xmark.stop()
                for proxy in proxies:
                    await asyncio.to_thread(proxy.stop)
    finally:
        upstream.stop()
        if xmark is not None:
            await xmark.drop()
    return results


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    fake_plain = [r for r in results if r["upstream"] == "fake" and not r["stream"]]
    one = [r for r in fake_plain if r["processes"] == 1]
    goals: dict[str, Any] = {}
    if one:
        cpu = [r["xmark"]["cpu_s_per_1000"] for r in one if r["xmark"]["cpu_s_per_1000"] is not None]
        goals["xmark_cpu_ms_per_request_max"] = max(cpu) if cpu else None
        c1 = [r for r in one if r["concurrency"] == 1]
        goals["xmark_added_p50_c1_ms"] = c1[0]["xmark"]["added_p50_ms"] if c1 else None
    multi = [r for r in fake_plain if r["processes"] > 1]
    if multi:
        goals["xmark_rps_workers"] = max(r["xmark"]["rps"] for r in multi)
    for name in ("xmark", "xmark_messages"):
        goals[f"{name}_non_2xx"] = {_cell_name(r): r["errors"][name] for r in results if r["errors"].get(name)}
    ratios = []  # where the gateways, not the upstream, set the pace
    for r in results:
        if r["upstream"] != "fake":
            continue
        for peer in ("litellm", "litellm_db"):
            if peer in r and r[peer]["rps"]:
                ratios.append(r["xmark"]["rps"] / r[peer]["rps"])
    goals["rps_vs_litellm_min_fake"] = min(ratios) if ratios else None
    goals["p50_p99_below_litellm_fake"] = all(
        r["xmark"][q] < r[peer][q]
        for r in results
        if r["upstream"] == "fake"
        for peer in ("litellm", "litellm_db")
        if peer in r
        for q in ("p50_ms", "p99_ms")
    )
    vllm = [r["xmark"].get("tokens_per_s_vs_direct") for r in results if r["upstream"] == "vllm"]
    goals["vllm_tokens_per_s_vs_direct"] = [v for v in vllm if v is not None]
    compared = [r for r in results if "messages_vs_chat" in r]
    if compared:  # /v1/messages within 10 % of chat: the largest ratio of any cell
        worst = {
            key: max(
                (
                    r["messages_vs_chat"][key]["ratio"]
                    for r in compared
                    if r["messages_vs_chat"][key]["ratio"] is not None
                ),
                default=None,
            )
            for key in ("added_p50", "cpu_per_request")
        }
        goals["messages_vs_chat_max"] = worst
        goals["messages_within_10_percent"] = all(v is not None and v <= 1.10 for v in worst.values())
    return goals


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gateways-") as folder:
        workdir = Path(folder)
        for kind in args.upstreams:
            if kind == "vllm" and not VLLM_PYTHON.exists():
                skipped["vllm"] = "no .venv-vllm (make venv-vllm)"
                continue
            cells, why = await run_upstream(kind, args, workdir)
            results += cells
            skipped.update(why)
    return {
        "results": results,
        "goals": _goals(results),
        "litellm_version": litellm_version() if args.litellm and LITELLM_PYTHON.exists() else None,
        "not_run": skipped,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.machine(),
        },
        "settings": {
            "seconds_per_cell": args.seconds,
            "seconds_per_vllm_cell": args.vllm_seconds,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "fake_tokens": FAKE_TOKENS,
            "vllm_tokens": VLLM_TOKENS,
            "prompt": PROMPT,
            "vllm_prompt": VLLM_PROMPT,
            # None: the worker shares every core with the rest; else its cores, and the others'
            "vllm_cores": args.vllm_cores,
            "vllm_others_cores": sorted(os.sched_getaffinity(0) - set(args.vllm_cores)) if args.vllm_cores else None,
            "vllm_postgres": "own server beside the gateway" if args.vllm_cores else "the shared server",
            "concurrency": args.concurrency,
            "processes": args.processes,
            "messages": args.messages,
        },
    }


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstreams", type=lambda t: t.split(","), default=["fake", "vllm"])
    parser.add_argument("--concurrency", type=_ints, default=[1, 16, 64, 256])
    parser.add_argument("--vllm-concurrency", type=_ints, default=[1, 16])
    parser.add_argument("--processes", type=_ints, default=[1, os.cpu_count() or 1])
    parser.add_argument("--vllm-processes", type=_ints, default=[1], help="gateway processes before vLLM")
    parser.add_argument(
        "--vllm-cores",
        type=_ints,
        default=None,
        help="cores of the vLLM forward pass's own (e.g. 0); the rest of the vLLM cells runs on the other cores",
    )
    parser.add_argument("--vllm-seconds", type=float, default=15.0, help="measured seconds per vLLM cell")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per cell and round")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-litellm", dest="litellm", action="store_false")
    parser.add_argument(
        "--no-messages", dest="messages", action="store_false", help="leave out the /v1/messages target"
    )
    parser.add_argument(
        "--database-prefix",
        default=DATABASE_PREFIX,
        help="the run's database name: this prefix and a random suffix (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.litellm and not LITELLM_PYTHON.exists():
        parser.error("LiteLLM's virtualenv is missing: make venv-litellm (or --no-litellm)")
    if args.vllm_cores is not None:
        allowed = os.sched_getaffinity(0)
        if not args.vllm_cores or not set(args.vllm_cores) < allowed:
            parser.error(f"--vllm-cores must name some, not all, of this process's cores {sorted(allowed)}")
    report = asyncio.run(main_async(args))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
