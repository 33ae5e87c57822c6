"""End to end with a real vLLM worker: watermark per user inside one vLLM batch, tracing, outages.

Runs only where vLLM is importable (``make test-vllm`` builds that environment); elsewhere the
module is skipped with the reason. The processes come from conftest.py: a CPU ``vllm serve``
with the XMark processor and an ``xmark serve`` gateway with ``XMARK_BACKEND=vllm`` on Postgres.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

pytestmark = [pytest.mark.vllm, pytest.mark.model]

MODEL = "smollm2-135m-instruct"
ALPHA = 1e-3
MAX_TOKENS = 256
# the sampling seeds of the batch of four answers (test_two_users_in_one_vllm_batch_...)
BATCH_SEEDS = (7101, 7102, 7103, 7104)
TOPICS = ["a lighthouse keeper", "a desert caravan", "a robot gardener", "a mountain village"]


def story(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long, detailed story about {topic}. Use many paragraphs."}]


async def create_user(client: httpx.AsyncClient, admin_key: str, name: str, role: str = "user") -> dict[str, Any]:
    response = await client.post(
        "/admin/users", json={"name": name, "role": role}, headers={"Authorization": f"Bearer {admin_key}"}
    )
    assert response.status_code == 201, response.text
    return response.json()


async def complete(client: httpx.AsyncClient, api_key: str, topic: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    """Non-streamed completion: (text, usage)."""
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": story(topic), "max_tokens": MAX_TOKENS, **extra},
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]


async def complete_streamed(
    client: httpx.AsyncClient, api_key: str, topic: str, **extra: Any
) -> tuple[str, dict[str, Any]]:
    """Streamed completion: (text assembled from the SSE deltas, usage from the last chunk)."""
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": story(topic),
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        },
        headers={"Authorization": f"Bearer {api_key}"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    return "".join(pieces), usage


async def trace(client: httpx.AsyncClient, auditor_key: str, suspect: str) -> dict[str, Any]:
    response = await client.post("/trace", json={"text": suspect}, headers={"Authorization": f"Bearer {auditor_key}"})
    assert response.status_code == 200, response.text
    return response.json()


async def running_requests(worker_url: str, stop: asyncio.Event) -> int:
    """Poll vLLM's Prometheus gauge of running requests; the largest value seen."""
    gauge = re.compile(r"^vllm:num_requests_running\{[^}]*\}\s+([0-9.]+)", re.MULTILINE)
    largest = 0
    async with httpx.AsyncClient(base_url=worker_url, timeout=5.0) as client:  # not a bound: errors are skipped
        while not stop.is_set():
            try:
                found = gauge.findall((await client.get("/metrics")).text)
                largest = max([largest, *(int(float(v)) for v in found)])
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    return largest


async def generation_rows(database_url: str, user_ids: list[int]) -> list[dict[str, Any]]:
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            result = await connection.execute(
                text(
                    "SELECT request_id, user_id, streamed, finish_reason, completion_tokens, prompt_tokens, "
                    "completion_text, completion_sha256 FROM generations WHERE user_id = ANY(:ids) ORDER BY id"
                ),
                {"ids": user_ids},
            )
            return [dict(row._mapping) for row in result]
    finally:
        await engine.dispose()


def worker_base(worker: Any) -> str:
    return str(worker.health_url).removesuffix("/health")


def gateway_base(gateway: Any) -> str:
    return str(gateway.health_url).removesuffix("/readyz")


@pytest.fixture(scope="module")
async def people(gateway: Any, e2e_config: Any) -> dict[str, dict[str, Any]]:
    # 5x margin and more: creating a user takes well under a second (0.3 s at most in tests/e2e here)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=60.0) as client:
        return {
            "alice": await create_user(client, e2e_config.admin_key, "alice"),
            "bob": await create_user(client, e2e_config.admin_key, "bob"),
            "auditor": await create_user(client, e2e_config.admin_key, "auditor", "auditor"),
        }


async def test_two_users_in_one_vllm_batch_are_each_traced_to_themselves(
    gateway: Any, vllm_worker: Any, e2e_config: Any, people: dict[str, dict[str, Any]]
) -> None:
    alice, bob, auditor = people["alice"], people["bob"], people["auditor"]
    stop = asyncio.Event()
    # 5x margin and more: these four answers of 256 tokens, in one batch of the CPU worker, took
    # 27 s here, and their traces 0.3 s at most
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=600.0) as client:
        # Each key's first request reads it from the database; a cheap one first, so the concurrent
        # completions below start side by side from the authentication cache.
        for person in (alice, bob):
            listed = await client.get("/v1/models", headers={"Authorization": f"Bearer {person['api_key']}"})
            assert listed.status_code == 200
        # a client-supplied vllm_xargs naming bob's message is refused before it reaches a worker
        refused = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": story(TOPICS[0]),
                "max_tokens": 8,
                "vllm_xargs": {"xmark_message": bob["message_id"], "xmark_key_version": "v1"},
            },
            headers={"Authorization": f"Bearer {alice['api_key']}"},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "vllm_xargs", refused.text
        poller = asyncio.create_task(running_requests(worker_base(vllm_worker), stop))
        # seeded, so that each answer is the same draw every run (an unseeded one ended after 25
        # tokens in a loaded run: too little to trace)
        results = await asyncio.gather(
            complete(client, alice["api_key"], TOPICS[0], seed=BATCH_SEEDS[0]),
            complete_streamed(client, alice["api_key"], TOPICS[1], seed=BATCH_SEEDS[1]),
            complete(client, bob["api_key"], TOPICS[2], seed=BATCH_SEEDS[2]),
            complete_streamed(client, bob["api_key"], TOPICS[3], seed=BATCH_SEEDS[3]),
        )
        stop.set()
        most_running = await poller
        # 4 requests, 2 per user: 3 or more running at once means both users shared a batch
        assert most_running >= 3, f"at most {most_running} requests ran together"

        authors = [alice, alice, bob, bob]
        for (completion, usage), author in zip(results, authors, strict=True):
            assert usage["completion_tokens"] >= 32, "too little text to trace"
            report = await trace(client, auditor["api_key"], completion)
            # The requirement is attribution (p < 1e-3 against the registry). The detection verdict
            # tests against all 2**b messages and needs more text than a short answer may give.
            # Each answer is a seeded draw (BATCH_SEEDS; the registry is seeded, conftest.py): up to
            # 256 tokens at temperature 1 (unseeded answers' p-values here were 4e-24 to 8e-31). The forensic
            # evaluation names 98-99 % of single 150-300 token answers among 10,000 IDs, a bar near
            # 1e-7 (docs/results/FORENSIC.md); among the few IDs here a miss is far rarer, but its
            # rate is not established below 1e-6.
            assert report["attribution"] is not None, report["candidates"]
            assert report["attribution"]["user_id"] == author["id"]
            assert report["attribution"]["p_value"] < ALPHA

    rows = await generation_rows(e2e_config.database_url, [alice["id"], bob["id"]])
    assert len(rows) == 4
    assert sorted((r["user_id"], r["streamed"]) for r in rows) == sorted(
        [(alice["id"], False), (alice["id"], True), (bob["id"], False), (bob["id"], True)]
    )
    texts = {completion for completion, _ in results}
    for row in rows:
        assert row["finish_reason"] in ("stop", "length")
        assert row["completion_text"] in texts
        assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0


async def test_a_request_sent_straight_to_vllm_without_xargs_is_not_watermarked(
    gateway: Any, vllm_worker: Any, people: dict[str, dict[str, Any]]
) -> None:
    # 5x margin and more: four answers of 256 tokens in one batch of the CPU worker took 27 s here
    async with httpx.AsyncClient(base_url=worker_base(vllm_worker), timeout=600.0) as worker:
        # seeded answers (seed after seed while they end early): the same unwatermarked text every
        # run, so the verdicts on it below are fixed
        answers: list[str] = []
        tokens = 0
        for seed in range(20240607, 20240607 + 4):
            response = await worker.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": story(TOPICS[0]), "max_tokens": MAX_TOKENS, "seed": seed},
            )
            assert response.status_code == 200
            answers.append(response.json()["choices"][0]["message"]["content"])
            tokens += response.json()["usage"]["completion_tokens"]
            if tokens >= MAX_TOKENS // 2:
                break
        plain = "\n\n".join(answers)
        rejected = await worker.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": story(TOPICS[0]), "max_tokens": 4, "vllm_xargs": {"xmark_message": "01"}},
        )
        assert rejected.status_code == 400
        assert "xmark_key_version is missing" in rejected.json()["error"]["message"]
    # 5x margin and more: this trace took 19-28 s here (the counting decoder names nobody, so the
    # likelihood decoder scores the text on the worker, for the first time); was 60 s: 2x that
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=300.0) as client:
        report = await trace(client, people["auditor"]["api_key"], plain)
    assert report["scored_tokens"] >= 32
    assert report["watermarked"] is False
    # the registry's IDs are seeded too (conftest.SEEDED_SERVE): the attribution p-value of this
    # fixed text is fixed (0.64 here, 168 scored tokens; with random IDs it fell below alpha with
    # probability up to 1e-3)
    assert report["attribution"] is None


async def test_dead_worker_gives_503s_and_complete_records_and_the_gateway_recovers(
    gateway: Any, vllm_worker: Any, e2e_config: Any, people: dict[str, dict[str, Any]]
) -> None:
    alice = people["alice"]
    headers = {"Authorization": f"Bearer {alice['api_key']}"}
    before = await generation_rows(e2e_config.database_url, [alice["id"]])
    # 5x margin and more: the longest request here, the first 5 chunks of a stream, takes seconds
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=300.0) as client:
        # the worker dies while a streamed answer is under way
        received: list[str] = []
        in_band_errors: list[dict[str, Any]] = []
        interrupted_ids: set[str] = set()
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            headers=headers,
            json={"model": MODEL, "messages": story(TOPICS[2]), "max_tokens": 600, "stream": True},
        ) as response:
            assert response.status_code == 200
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:  # the gateway reports the failure in the stream
                        in_band_errors.append(chunk["error"])
                        continue
                    interrupted_ids.add(chunk["id"])
                    for choice in chunk["choices"]:
                        received.append(choice["delta"].get("content") or "")
                    if sum(1 for piece in received if piece) == 5:
                        vllm_worker.kill()
            except httpx.HTTPError:
                pass  # or ends the response abruptly
        assert sum(1 for piece in received if piece) >= 5
        assert all(e["code"] == "upstream_unavailable" for e in in_band_errors)
        assert vllm_worker.process.poll() is not None

        for stream in (False, True):
            response = await client.post(
                "/v1/chat/completions",
                headers=headers,
                json={"model": MODEL, "messages": story(TOPICS[0]), "max_tokens": 16, "stream": stream},
            )
            assert response.status_code == 503
            assert response.headers["content-type"].startswith("application/json")
            error = response.json()["error"]
            assert error["code"] == "upstream_unavailable" and error["type"] == "service_unavailable"
        assert (await client.get("/readyz")).status_code == 200  # the gateway itself stays up

        vllm_worker.start()
        vllm_worker.wait_healthy(900.0)  # 5x margin and more: a CPU worker starts in 40-142 s here
        # 5x margin and more: the gateway probes every second (XMARK_VLLM_HEALTH_INTERVAL_S), so
        # the restarted worker is back in rotation within a few seconds
        deadline = time.monotonic() + 60
        while True:
            response = await client.post(
                "/v1/chat/completions",
                headers=headers,
                json={"model": MODEL, "messages": story(TOPICS[1]), "max_tokens": 16},
            )
            if response.status_code == 200 or time.monotonic() > deadline:
                break
            assert response.status_code == 503
            await asyncio.sleep(1.0)
        assert response.status_code == 200, response.text
        recovered_id = response.json()["id"]

    # the recovered completion's row is committed as its response ends; allow for a slow machine:
    # 5x margin and more, the row was there 0.03 s after the response in tests/e2e here
    deadline = time.monotonic() + 30
    while True:
        rows = await generation_rows(e2e_config.database_url, [alice["id"]])
        new_rows = {row["request_id"]: row for row in rows[len(before) :]}
        if recovered_id in new_rows or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert recovered_id in new_rows, "the completion served after the recovery was not recorded"
    assert new_rows[recovered_id]["finish_reason"] in ("stop", "length")
    assert len(interrupted_ids) == 1
    # nothing for the refused requests; the interrupted stream, if recorded, holds exactly what
    # the client received and is marked as not finished
    assert set(new_rows) - interrupted_ids == {recovered_id}
    for request_id in interrupted_ids & set(new_rows):
        row = new_rows[request_id]
        assert row["streamed"] is True and row["finish_reason"] in ("error", "cancelled")
        assert row["completion_text"] == "".join(received)
