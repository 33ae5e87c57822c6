"""End to end: admin API -> users -> official OpenAI client -> watermarked completions -> /trace.

Everything is real: uvicorn on a local port, PostgreSQL, the SmolLM2 model, the openai package.
Two users each receive at least 150 completion tokens (one plain and one streamed request); the
concatenation of each user's completions is traced back to that user, never to the other, and
the same model's unwatermarked output is attributed to nobody.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import torch
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from service.cli.offline_trace import offline_trace

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
MIN_TOKENS = 150
MAX_TOKENS_PER_REQUEST = 200
TEMPERATURE = 0.8
PROMPTS = {
    "alice": (
        "Write a detailed, multi-paragraph essay about the history of the printing press and how it changed Europe.",
        "Explain step by step, in depth, how the human immune system fights a viral infection.",
    ),
    "bob": (
        "Write a long, detailed guide to growing tomatoes in a home garden, from seed to harvest.",
        "Describe in detail how steam engines work and why they mattered for the industrial revolution.",
    ),
}


@dataclass
class UserRun:
    name: str
    user_id: int
    api_key: str
    texts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    request_ids: list[str] = field(default_factory=list)


def _admin(server: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.admin_key}"}


def _create_user(server: Any, name: str) -> UserRun:
    response = httpx.post(f"{server.base_url}/admin/users", json={"name": name, "role": "user"}, headers=_admin(server))
    assert response.status_code == 201, response.text
    created = response.json()
    return UserRun(name=name, user_id=created["id"], api_key=created["api_key"])


def _plain_request(server: Any, run: UserRun, prompt: str) -> None:
    # 5x margin and more: a round of two concurrent 200-token answers took 35 s here, and about
    # 140 s on two cores also busy with other test runs (was 600 s: 4x that)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=run.api_key, max_retries=0, timeout=1800)
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS_PER_REQUEST,
        temperature=TEMPERATURE,
    )
    assert completion.object == "chat.completion"
    assert completion.usage is not None
    assert completion.usage.completion_tokens > 0
    run.texts.append(completion.choices[0].message.content or "")
    run.completion_tokens += completion.usage.completion_tokens
    run.request_ids.append(completion.id)


def _streamed_request(server: Any, run: UserRun, prompt: str) -> None:
    # 5x margin and more: a round of two concurrent 200-token answers took 35 s here, and about
    # 140 s on two cores also busy with other test runs (was 600 s: 4x that)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=run.api_key, max_retries=0, timeout=1800)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS_PER_REQUEST,
        temperature=TEMPERATURE,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    finish_reasons = []
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(ids) == 1
    assert len(finish_reasons) == 1
    assert usage is not None and usage.completion_tokens > 0
    run.texts.append("".join(pieces))
    run.completion_tokens += usage.completion_tokens
    run.request_ids.append(ids.pop())


def _trace(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    # 5x margin and more: a trace of up to 400 tokens took at most 2.5 s here
    response = httpx.post(f"{server.base_url}/trace", json=body, headers=_admin(server), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _unwatermarked_text(server: Any, prompts: tuple[str, ...]) -> str:
    """The same model and sampling, generated without the gateway (no watermark), joined."""
    path = server.settings.resolved_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    config = GenerationConfig(
        max_new_tokens=MAX_TOKENS_PER_REQUEST,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(20240607)
    texts = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.inference_mode():
            output = model.generate(**ids, generation_config=config)  # [1, prompt + new] int64
        prompt_length = ids["input_ids"].shape[1]
        texts.append(tokenizer.decode(output[0, prompt_length:], skip_special_tokens=True))
    return "\n\n".join(texts)


async def test_each_user_is_traced_from_their_own_completions(live_server: Any, e2e_db: AsyncEngine) -> None:
    runs = {name: _create_user(live_server, name) for name in PROMPTS}

    # both users at once, so their requests share batched generate calls
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda n: _plain_request(live_server, runs[n], PROMPTS[n][0]), PROMPTS))
        list(pool.map(lambda n: _streamed_request(live_server, runs[n], PROMPTS[n][1]), PROMPTS))

    for run in runs.values():
        assert run.completion_tokens >= MIN_TOKENS, (run.name, run.completion_tokens)

    async with e2e_db.connect() as connection:
        for run in runs.values():
            # a record the database could not take at once (the two cores busy) is spooled and drained
            # into it within record_spool_drain_interval_s (2 s): wait for it, 15x that at most
            deadline = time.monotonic() + 30.0
            while True:
                rows = (
                    await connection.execute(
                        text(
                            "SELECT request_id, streamed, completion_text, completion_tokens, key_version_id "
                            "FROM generations WHERE user_id = :uid ORDER BY id"
                        ),
                        {"uid": run.user_id},
                    )
                ).all()
                await connection.commit()  # the next read sees rows committed since
                if len(rows) >= len(run.request_ids) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.25)
            assert [r.request_id for r in rows] == run.request_ids
            assert [r.streamed for r in rows] == [False, True]
            assert [r.completion_text for r in rows] == run.texts
            assert sum(r.completion_tokens for r in rows) == run.completion_tokens

    # Each user's text is a draw: not seeded, since a seeded request runs alone and these are meant
    # to share batched generate calls. Measured here: p-values of 1.6e-49 and 3.6e-38 (300-400
    # tokens, named at 1e-3 among three IDs); the forensic evaluation names 98-99 % of single
    # 300-token answers among 10,000 IDs, a bar near 1e-7 (docs/results/FORENSIC.md). A miss here is
    # far rarer than that, but its rate is not established below 1e-6. The unwatermarked text and
    # the registry (tests/e2e/conftest.py) are seeded: the verdict on that text is fixed.
    for run in runs.values():
        other = next(r for r in runs.values() if r is not run)
        report = _trace(live_server, {"text": "\n\n".join(run.texts), "model": MODEL})
        attribution = report["attribution"]
        assert attribution is not None, (run.name, report["p_value"], report["candidates"][:2])
        assert attribution["user_id"] == run.user_id
        assert attribution["name"] == run.name
        assert attribution["p_value"] < 1e-3
        assert report["candidates"][0]["user_id"] == run.user_id
        assert attribution["user_id"] != other.user_id
        # the command-line trace (no server, no model: the counting decoder) reaches the same report
        # as the server's counting decoder from the same configuration
        counting = _trace(live_server, {"text": "\n\n".join(run.texts), "model": MODEL, "decoder": "counting"})
        offline = await asyncio.to_thread(offline_trace, live_server.settings, "\n\n".join(run.texts))
        assert counting["report_id"] is not None  # only the server records (and signs) a report
        assert offline == {**counting, "report_id": None}

    plain = _unwatermarked_text(live_server, PROMPTS["alice"])
    report = _trace(live_server, {"text": plain})
    assert report["scored_tokens"] >= MIN_TOKENS
    assert report["attribution"] is None
    assert report["watermarked"] is False


@pytest.mark.parametrize("read_chunks", [4])
async def test_client_disconnect_midway_records_what_was_sent(
    live_server: Any, e2e_db: AsyncEngine, read_chunks: int
) -> None:
    run = _create_user(live_server, "leaver")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
        "max_tokens": 400,
        "temperature": 0.9,
        # seeded sampling: the answer is the same every run, so it never ends (EOS) before the
        # chunks read below, which would leave nothing to cancel
        "seed": 20240607,
        "stream": True,
    }
    received: list[str] = []
    request_id = None
    headers = {"Authorization": f"Bearer {run.api_key}"}
    async with (
        # 5x margin and more: the first chunks of the answer arrived within a second here
        httpx.AsyncClient(base_url=live_server.base_url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        content_chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = httpx.Response(200, content=line[len("data: ") :]).json()
            request_id = chunk["id"]
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                received.append(content)
                content_chunks += 1
            if content_chunks >= read_chunks:
                break  # leave: closing the response drops the connection
    assert request_id is not None

    row = None
    async with e2e_db.connect() as connection:
        for _ in range(240):  # a 60 s deadline, 5x margin and more: the row was there at the first look here
            row = (
                await connection.execute(
                    text(
                        "SELECT finish_reason, completion_tokens, completion_text, streamed "
                        "FROM generations WHERE request_id = :rid"
                    ),
                    {"rid": request_id},
                )
            ).one_or_none()
            if row is not None:
                break
            await connection.rollback()
            await asyncio.sleep(0.25)
    assert row is not None, "the interrupted generation was not recorded"
    assert row.finish_reason == "cancelled"
    assert row.streamed is True
    assert read_chunks <= row.completion_tokens < 400
    assert row.completion_text.startswith("".join(received))
