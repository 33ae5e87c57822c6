"""POST /v1/completions (legacy text completions) on the local backend: the OpenAI shapes, streamed
and not, ``echo``, the refused fields by name, the generation record, and the caller's watermark."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
PROMPT = "The three primary colours are"


@pytest.fixture
async def user_key(app: Any, make_user: Any, seeded_message_ids: Any) -> tuple[dict[str, Any], str]:
    # the user's message ID comes from the seeded allocation (tests/service/conftest.py): with the
    # sampling seeded, the watermarked answer, and its verdict, are the same on every run
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"
    return await make_user("user")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_text_completion_is_served_and_recorded(
    client: httpx.AsyncClient, user_key: Any, db_session: AsyncSession
) -> None:
    principal, key = user_key
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers=_auth(key),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] and choice["finish_reason"] in {"stop", "length"}
    assert 0 < body["usage"]["completion_tokens"] <= 8
    row = (await db_session.execute(select(Generation).where(Generation.request_id == body["id"]))).scalar_one()
    assert row.user_id == principal["user_id"]
    assert row.completion_sha256 == hashlib.sha256(choice["text"].encode()).hexdigest()
    assert row.completion_tokens == body["usage"]["completion_tokens"]


async def test_default_length_echo_and_stream(client: httpx.AsyncClient, user_key: Any) -> None:
    _, key = user_key
    plain = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0}, headers=_auth(key)
    )
    assert plain.status_code == 200
    assert plain.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default for this endpoint
    text = plain.json()["choices"][0]["text"]

    echoed = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, "echo": True}, headers=_auth(key)
    )
    assert echoed.json()["choices"][0]["text"] == PROMPT + text
    assert echoed.json()["usage"] == plain.json()["usage"]

    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body, headers=_auth(key)) as streamed:
        assert streamed.status_code == 200
        async for line in streamed.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            assert chunk["object"] == "text_completion"
            pieces.extend(c["text"] for c in chunk["choices"])
            usage = chunk.get("usage") or usage
    assert "".join(pieces) == text  # greedy: the same continuation
    assert usage == plain.json()["usage"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"suffix": " the end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 2}, "logprobs"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),
        ({"vllm_xargs": {"xmark_message": "0" * 32}}, "vllm_xargs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
async def test_refused_fields_are_named(
    client: httpx.AsyncClient, user_key: Any, fields: dict[str, Any], param: str
) -> None:
    _, key = user_key
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}
    response = await client.post("/v1/completions", json=body, headers=_auth(key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_the_openai_client_and_the_watermark(
    app: Any, client: httpx.AsyncClient, user_key: Any, make_user: Any
) -> None:
    principal, key = user_key
    _, auditor = await make_user("auditor")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=key, base_url="http://testserver/v1", http_client=http) as sdk:
        completion = await sdk.completions.create(
            model=MODEL,
            prompt="Write a long, detailed story about a lighthouse keeper.\n\nOnce upon a time",
            max_tokens=200,
            temperature=1.0,
            n=4,  # a raw continuation may end early at the end-of-text token: four make enough text
            seed=17,  # the four rows are one request, alone in its batch: seeded sampling
        )
    # every choice carries the caller's watermark: traced together they are one longer text
    text = "\n\n".join(choice.text for choice in completion.choices)
    assert completion.usage is not None and completion.usage.completion_tokens >= 150, text
    report = await client.post("/trace", json={"text": text}, headers=_auth(auditor))
    assert report.status_code == 200, report.text
    attribution = report.json()["attribution"]
    assert attribution is not None and attribution["user_id"] == principal["user_id"], report.json()["candidates"]
