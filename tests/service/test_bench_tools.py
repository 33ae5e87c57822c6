"""The gateway benchmark's own tools (benchmarks.fake_upstream, benchmarks.loadgen), run for real on
loopback: what they report must be true, or every figure built on them is wrong."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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

from benchmarks.end_users_bench import access_counts
from benchmarks.launch import free_port
from benchmarks.registry_memory import measure, rows
from service.logging import RedactingFormatter
from service.services.registry_cache import build_snapshot
from xmark_core import WatermarkParams

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
        deadline = time.monotonic() + 30  # 5x margin and more: it answered 0.7 s after its start here
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
        process.wait(10)  # 5x margin and more: it stopped in 0.14 s here


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
    # a process that lives 30 s: the 0.5 s timeout below must fire while it lives (5x margin and
    # more: it was 1.1 s old then here); a wait that ignored its timeout would end at the exit, with
    # another error
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:

        async def finish_later() -> None:
            await asyncio.sleep(0.5)
            with log.open("a") as handle:
                handle.write(f'{{"message": "{bench_gateways.START_UP_DONE}"}}\n' * 2)

        async def both() -> float:
            started = time.monotonic()
            # timeout 10 s: 5x margin and more, it returned 0.53 s after it began here (the lines
            # are written at 0.5 s)
            await asyncio.gather(bench_gateways.wait_start_up(log, 2, process, timeout=10), finish_later())
            return time.monotonic() - started

        assert asyncio.run(both()) >= 0.5
        with pytest.raises(RuntimeError, match="did not finish start-up"):
            asyncio.run(bench_gateways.wait_start_up(log, 3, process, timeout=0.5))
    finally:
        process.kill()
        process.wait()
    # the exit is noticed at once (0.001 s here), not at the timeout (10 s), which gives another error
    with pytest.raises(RuntimeError, match="exited during start-up"):
        asyncio.run(bench_gateways.wait_start_up(log, 3, process, timeout=10))


def test_the_messages_cell_asks_what_the_chat_cell_asks_in_anthropics_shape() -> None:
    """``bench_gateways``: the /v1/messages target sends the chat target's prompt, ``max_tokens``,
    temperature and stream flag as a valid Messages request (no chat-only field such as
    ``stream_options``, which the route refuses by name)."""
    from benchmarks import bench_gateways
    from service.schemas.messages import MessagesRequest

    for stream in (False, True):
        chat = json.loads(bench_gateways._body(stream, 16, {}))
        messages = json.loads(bench_gateways._body(stream, 16, {}, api="messages"))
        request = MessagesRequest.model_validate(messages)
        assert request.model_extra in (None, {})
        assert {k: chat[k] for k in messages} == messages
        assert set(chat) - set(messages) == ({"stream_options"} if stream else set())


def test_messages_over_chat_pairs_each_round_with_its_own() -> None:
    """``bench_gateways.messages_vs_chat``: the pooled ratios, and the range of the rounds' own ratios."""
    from benchmarks import bench_gateways

    chat = {"added_p50_ms": 1.0, "added_p50_ms_rounds": [0.9, 1.1], "cpu_s_per_1000": 2.0}
    chat["cpu_s_per_1000_rounds"] = [2.0, 2.0]
    messages = {"added_p50_ms": 1.05, "added_p50_ms_rounds": [0.99, 1.1], "cpu_s_per_1000": 2.2}
    messages["cpu_s_per_1000_rounds"] = [2.1, 2.3]
    ratios = bench_gateways.messages_vs_chat(chat, messages)
    assert ratios["added_p50"]["ratio"] == pytest.approx(1.05)
    assert ratios["added_p50"]["range"] == pytest.approx([1.0, 1.1])
    assert ratios["cpu_per_request"]["ratio"] == pytest.approx(1.1)
    assert ratios["cpu_per_request"]["range"] == pytest.approx([1.05, 1.15])
    assert "messages / chat: added p50 1.050 (rounds 1.000–1.100)" in bench_gateways._ratio_row(ratios)


def test_the_soak_reads_each_routes_completion_id_from_its_stream() -> None:
    """``soak``: a chat stream's id from any chunk; a message's from its ``message_start`` event (as
    the route serializes it), and its first text from a ``text_delta``."""
    from benchmarks import soak
    from service.schemas.messages import (
        ContentBlockDeltaEvent,
        MessageObject,
        MessageStartEvent,
        MessageUsage,
        TextDelta,
    )

    usage = MessageUsage(input_tokens=3, output_tokens=0)
    start = MessageStartEvent(message=MessageObject(id="msg_0a1b", content=[], model="m", usage=usage))
    delta = ContentBlockDeltaEvent(index=0, delta=TextDelta(text="Hi"))
    assert soak.stream_id("messages", f"data: {start.model_dump_json()}") == "msg_0a1b"
    assert soak.stream_id("messages", f"data: {delta.model_dump_json()}") is None
    assert soak.stream_id("messages", "event: message_start") is None
    assert soak.first_text("messages", f"data: {delta.model_dump_json()}")
    assert not soak.first_text("messages", f"data: {start.model_dump_json()}")
    chunk = 'data: {"id":"chatcmpl-9f","choices":[{"index":0,"delta":{"content":"Hi"}}]}'
    assert soak.stream_id("chat", chunk) == "chatcmpl-9f" and soak.first_text("chat", chunk)
    assert {route for route, _ in soak.KINDS} == {"chat", "messages"}


def test_the_difference_of_two_rates_has_newcombes_interval() -> None:
    """``trace_naming.difference_ci95``: Newcombe's (1998) hybrid score interval, his worked examples."""
    from benchmarks.trace_naming import difference_ci95

    assert difference_ci95(56, 70, 48, 80) == pytest.approx([0.0524, 0.3339], abs=1e-4)
    assert difference_ci95(9, 10, 3, 10) == pytest.approx([0.1705, 0.8090], abs=1e-4)
    assert difference_ci95(5, 56, 0, 29) == pytest.approx([-0.0381, 0.1926], abs=1e-4)


def test_the_end_user_race_counts_the_gateways_answers_from_its_access_log(tmp_path: Path) -> None:
    """``access_counts`` reads the lines the gateway's own formatter writes (``xmark.access``) and
    counts one account's answers on one route by status; other accounts, routes, loggers and a
    line cut short are not counted."""
    formatter = RedactingFormatter()
    log = tmp_path / "gateway.log"

    def line(logger: str, **extra: Any) -> str:
        record = logging.LogRecord(logger, logging.INFO, __file__, 1, "request", None, None)
        record.__dict__.update(extra)
        return formatter.format(record)

    chat = "/v1/chat/completions"
    lines = [
        *(line("xmark.access", route=chat, status=200, user_id=3) for _ in range(4)),
        line("xmark.access", route=chat, status=503, user_id=3),
        line("xmark.access", route=chat, status=200, user_id=4),
        line("xmark.access", route="/v1/completions", status=200, user_id=3),
        line("xmark.end_users", route=chat, status=200, user_id=3),
        line("xmark.access", route=chat, status=200, user_id=3)[:40],
    ]
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert access_counts(log, 3) == {"200": 4, "503": 1}
    assert access_counts(log, 4) == {"200": 1}
    assert access_counts(log, 3, "/v1/completions") == {"200": 1}


def test_the_registry_memory_benchmark_builds_the_caches_snapshot_of_its_rows() -> None:
    """``benchmarks.registry_memory`` measures the snapshot ``/trace`` scores against, built by the
    cache's own builder: every row's ID is a candidate, held by the end user it was read for."""
    params = WatermarkParams(bits=32, block_bits=2)
    entries = [entry for piece in rows(3, 4, params.bits) for entry in piece]  # one slice: 12 < LOAD_SLICE
    snapshot = build_snapshot(entries, params)
    assert len(snapshot) == 12 and len({e.message_id for e in entries}) == 12
    holders = {user.end_user_id: (user.user_id, user.name, user.identifier) for user in snapshot.users.values()}
    assert holders == {e.end_user_id: (e.user_id, f"platform-{e.user_id}", e.identifier) for e in entries}
    assert sorted(snapshot.candidates.ids) == sorted(-e.end_user_id for e in entries)
    measured = measure(5, 20, params)
    assert measured["ids"] == 100 and measured["accounts"] == 5 and measured["end_users_per_account"] == 20


def test_the_registry_scale_evaluation_draws_distinct_ids_and_reads_them_as_the_gateway_does() -> None:
    """The 10^7-ID registries of ``eval-registry-scale``: distinct random IDs outside the allocated
    ones, of the message length asked, and their blocks as ``bits_to_blocks`` reads the bit strings
    (for the keyed sampler's 8-bit blocks and the biasing encoder's 2-bit ones)."""
    import numpy as np

    from benchmarks.evaluation.registry_scale import id_blocks, random_ids
    from xmark_core import WatermarkParams
    from xmark_core.message import bits_to_blocks

    for bits in (32, 48, 64):
        taken = random_ids(np.zeros(0, dtype=np.uint64), bits, 1_000, seed=1)
        drawn = random_ids(taken, bits, 50_000, seed=2)
        assert drawn.size == 50_000 and np.unique(drawn).size == 50_000
        assert not np.isin(drawn, taken).any()
        assert bits == 64 or int(drawn.max()) < 1 << bits
        assert np.array_equal(drawn, random_ids(taken, bits, 50_000, seed=2))  # seeded
        strings = [format(int(v), f"0{bits}b") for v in drawn[:500]]
        for block_bits, scheme in ((8, "gumbel"), (2, "xmark")):
            params = WatermarkParams(bits=bits, block_bits=block_bits, num_keys=1, scheme=scheme)
            assert np.array_equal(id_blocks(drawn[:500], params), bits_to_blocks(strings, params))
