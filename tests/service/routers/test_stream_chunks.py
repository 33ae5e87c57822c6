"""Streamed completions: chunks shaped as OpenAI's (one entry per choice index, the finish reason
on the entry the ``openai`` SDK reads), ``[DONE]`` only after a durable record when
``record_before_response`` is set (streams the client leaves: tests/service/db/test_record_faults.py).

The app serves the fake backend unless a selected test needs the model; the records are
written in the test's rolled-back transaction.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.types import Message, Receive, Scope, Send

from service.models import Generation


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _body(app: Any, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": app.state.resources.backend.model_id,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12,
        "stream": True,
    }
    body.update(overrides)
    return body


@pytest.fixture
async def user_key(app: Any, make_user: Any) -> str:
    assert await app.state.resources.backend.wait_ready(180)
    _, key = await make_user("user")
    return str(key)


@pytest.fixture
async def sdk(app: Any, client: httpx.AsyncClient, user_key: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(api_key=user_key, base_url="http://testserver/v1", http_client=client) as sdk:
        yield sdk


def _chunks(raw: str) -> tuple[list[dict[str, Any]], str]:
    payloads = [block[len("data: ") :] for block in raw.split("\n\n") if block.startswith("data: ")]
    return [json.loads(p) for p in payloads[:-1]], payloads[-1]


@pytest.mark.parametrize("max_tokens", [3, 200])  # ends by length (with its last text), by stop
async def test_the_openai_sdk_reads_the_finish_reason_on_choices_0(
    app: Any, sdk: openai.AsyncOpenAI, max_tokens: int
) -> None:
    stream = await sdk.chat.completions.create(
        model=app.state.resources.backend.model_id,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    reasons: list[str] = []
    text = ""
    async for chunk in stream:
        if chunk.choices:  # what an SDK user reads: choices[0]
            assert len(chunk.choices) == 1
            if chunk.choices[0].finish_reason is not None:
                reasons.append(chunk.choices[0].finish_reason)
            text += chunk.choices[0].delta.content or ""
    assert len(reasons) == 1 and reasons[0] in {"stop", "length"}
    assert text and chunk.usage is not None and chunk.usage.completion_tokens <= max_tokens


async def test_every_chunk_has_one_entry_per_index_and_each_index_finishes_once(
    app: Any, client: httpx.AsyncClient, user_key: str
) -> None:
    body = _body(app, n=3, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(user_key)) as response:
        assert response.status_code == 200
        raw = (await response.aread()).decode()
    chunks, done = _chunks(raw)
    assert done == "[DONE]"
    for chunk in chunks:
        indexes = [c["index"] for c in chunk["choices"]]
        assert len(indexes) == len(set(indexes)), chunk
    finished = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"] is not None]
    assert sorted(finished) == [0, 1, 2]
    # an entry that finishes a choice may carry its last text, as OpenAI's may
    for chunk in chunks:
        for entry in chunk["choices"]:
            assert set(entry["delta"]) <= {"role", "content"}


async def _done_probe(app: Any, seen: list[int], rows: Any, db_session: AsyncSession) -> Any:
    """The app, with the committed rows counted when the ``[DONE]`` event is sent."""

    async def probed(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_probed(message: Message) -> None:
            if message["type"] == "http.response.body" and b"[DONE]" in message.get("body", b""):
                seen.append(int(await db_session.scalar(rows) or 0))
            await send(message)

        await app(scope, receive, send_probed)

    return probed


@pytest.mark.parametrize("before", [True, False])
async def test_with_record_before_response_done_follows_the_record(
    app: Any, db_session: AsyncSession, user_key: str, before: bool
) -> None:
    principal = await app.state.resources.authenticator.authenticate(f"Bearer {user_key}")
    rows = select(func.count()).select_from(Generation).where(Generation.user_id == principal.user_id)
    seen: list[int] = []
    default = app.state.resources.settings
    app.state.resources.settings = default.model_copy(update={"record_before_response": before})
    try:
        transport = httpx.ASGITransport(app=await _done_probe(app, seen, rows, db_session))
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://testserver") as client,
            client.stream("POST", "/v1/chat/completions", json=_body(app, n=2), headers=_auth(user_key)) as response,
        ):
            raw = (await response.aread()).decode()
    finally:
        app.state.resources.settings = default
    assert _chunks(raw)[1] == "[DONE]"
    assert seen == ([2] if before else [0])  # the default: the record follows the stream's end
    assert await db_session.scalar(rows) == 2
