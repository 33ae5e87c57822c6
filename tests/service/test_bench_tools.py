"""The gateway benchmark's own tools (benchmarks.fake_upstream, benchmarks.loadgen), run for real on
loopback: what they report must be true, or every figure built on them is wrong."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from benchmarks.launch import free_port

BODY = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.fake_upstream", "--port", str(port), "--tokens", "5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the fake upstream did not start"
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(10)


def _load(url: str, *extra: str, body: str = BODY) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", url, "--body", body, "--seconds", "0.5"]
    done = subprocess.run([*command, "--warmup", "0.1", *extra], capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout))


async def test_the_fake_upstream_speaks_openai_streamed_and_not(upstream: str) -> None:
    async with httpx.AsyncClient(base_url=upstream) as client:
        plain = (await client.post("/v1/chat/completions", content=BODY)).json()
        assert plain["choices"][0]["message"]["content"] == "Hello there, how can"
        assert plain["usage"]["completion_tokens"] == 5
        streamed = await client.post("/v1/chat/completions", content=BODY.replace("{", '{"stream": true, ', 1))
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "Hello there, how can"
        assert chunks[0]["prompt_token_ids"] and all(c["choices"][0]["token_ids"] for c in chunks if c["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert (await client.post("/v1/nothing", content=BODY)).status_code == 404


async def test_the_load_generator_keeps_its_connections_and_counts_right(upstream: str) -> None:
    url = f"{upstream}/v1/chat/completions"
    result = await asyncio.to_thread(_load, url, "--concurrency", "4", "--count-tokens")
    assert result["connections"] == 4  # keep-alive: one connection per client, never one per request
    assert result["requests"] > 20 and result["errors"] == {} and result["transport_errors"] == 0
    assert result["answered"] >= result["requests"]  # the warm-up's answers too
    assert result["tokens"] == 5 * result["requests"]
    assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    streamed = await asyncio.to_thread(_load, url, "--count-tokens", body=BODY.replace("{", '{"stream": true, ', 1))
    assert streamed["events_per_request"] == 7  # five tokens, the usage chunk, [DONE]
    assert streamed["tokens"] == 5 * streamed["requests"]


async def test_the_load_generator_counts_refusals_by_status_with_a_sample(upstream: str) -> None:
    result = await asyncio.to_thread(_load, f"{upstream}/v1/nothing")
    assert result["requests"] == 0 and result["errors"]["404"] > 0
    assert set(result["error_samples"]) == {"404"}


def _listeners(port: int) -> list[psutil.Process]:
    return [
        psutil.Process(c.pid)
        for c in psutil.net_connections("tcp")
        if c.pid and c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    ]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to set one apart")
def test_pinning_beside_the_worker_moves_the_run_and_its_own_postgres_off_the_worker_cores() -> None:
    """``bench_gateways --vllm-cores``: the run, and the PostgreSQL server it starts, leave the
    worker's cores while the pin lasts; the vLLM worker is told to bind its compute threads there;
    the run's cores come back, and its server goes, afterwards."""
    from benchmarks import bench_gateways, pg_server

    if not pg_server.available():
        pytest.skip("no PostgreSQL binaries to run a private server")
    before = os.sched_getaffinity(0)
    worker = [min(before)]
    with contextlib.ExitStack() as stack:
        base_url = bench_gateways._pin_beside_worker(worker, stack)
        assert os.sched_getaffinity(0) == before - set(worker)
        port = int(base_url.rsplit(":", 1)[1])
        servers = _listeners(port)
        assert servers, "the run's own PostgreSQL server is not listening"
        assert all(set(server.cpu_affinity()) == before - set(worker) for server in servers)
    assert os.sched_getaffinity(0) == before
    assert not _listeners(port)
    pinned = bench_gateways.Upstream("vllm", Path("/tmp"), max_num_seqs=1, cores=worker)
    assert pinned.env["VLLM_CPU_OMP_THREADS_BIND"] == str(worker[0])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in bench_gateways.Upstream("vllm", Path("/tmp"), max_num_seqs=1).env


def test_the_benchmark_waits_for_every_gateway_process_to_end_its_start_up(tmp_path: Path) -> None:
    """``bench_gateways.wait_start_up``: returns once as many processes as asked have logged the end
    of their start-up work, and fails (never waits forever) when they do not."""
    from benchmarks import bench_gateways

    log = tmp_path / "gateway.log"
    log.write_text('{"message": "trace null distributions ready"}\n')
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:

        async def finish_later() -> None:
            await asyncio.sleep(0.5)
            with log.open("a") as handle:
                handle.write(f'{{"message": "{bench_gateways.START_UP_DONE}"}}\n' * 2)

        async def both() -> float:
            started = time.monotonic()
            await asyncio.gather(bench_gateways.wait_start_up(log, 2, process, timeout=10), finish_later())
            return time.monotonic() - started

        assert asyncio.run(both()) >= 0.5
        with pytest.raises(RuntimeError, match="did not finish start-up"):
            asyncio.run(bench_gateways.wait_start_up(log, 3, process, timeout=0.5))
    finally:
        process.kill()
        process.wait()
    with pytest.raises(RuntimeError, match="exited during start-up"):
        asyncio.run(bench_gateways.wait_start_up(log, 3, process, timeout=10))
