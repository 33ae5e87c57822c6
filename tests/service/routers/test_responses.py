"""POST /v1/responses through the official ``openai`` client, on the real model and database: the
answer and its usage, the typed stream, the translation into chat (instructions, developer and
replayed assistant turns), every refused field named, and the point of it all: a response's text
is traced to its caller, with its generation record as the corroborating witness."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import UpstreamUnavailableError
from service.models import Generation
from tests.service.trace.test_trace import ESSAY

# the traced answer and its verdict depend on the users' message IDs: drawn from a seeded generator
# (tests/service/conftest.py), with the sampling seeded (below), they give one outcome on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]

MODEL = "smollm2-135m-instruct"
PROMPT = "Name three colours."
# a prompt no answer ends within a few tokens, asked greedily: the cut is certain on every run
LONG_PROMPT = "Write a long, detailed essay on the history of the Roman Empire."


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def author(make_user: Any, ready: None) -> tuple[dict[str, Any], str]:
    return await make_user("user", "responses-author")


@pytest.fixture
async def sdk(app: Any, author: tuple[dict[str, Any], str]) -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=author[1], base_url="http://testserver/v1", http_client=http) as client:
        yield client


async def _record(session: AsyncSession, request_id: str) -> Generation:
    """The generation row of ``request_id``; it is written as the response ends, so wait for it."""
    for _ in range(100):
        row = await session.scalar(select(Generation).where(Generation.request_id == request_id))
        if row is not None:
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"no generation record for {request_id}")


async def test_a_response_is_returned_and_recorded(
    client: httpx.AsyncClient, sdk: openai.AsyncOpenAI, db_session: AsyncSession, author: Any
) -> None:
    response = await sdk.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=20, temperature=0, metadata={"case": "7"}
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text.strip()
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.text == response.output_text and part.annotations == []
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 20
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    # cut by the token budget only when it used all of it (an end token can also fall on the last place,
    # so at exactly 20 tokens the recorded finish reason decides)
    row = await _record(db_session, response.id)
    if usage.output_tokens < 20 or row.finish_reason == "stop":
        assert response.status == "completed" and response.incomplete_details is None
        assert message.status == "completed" and response.completed_at is not None
    else:
        assert row.finish_reason == "length"
        assert response.status == "incomplete" and response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.temperature == 0 and response.top_p == 1.0 and response.max_output_tokens == 20
    assert response.metadata == {"case": "7"} and response.tools == [] and response.error is None

    assert row.user_id == author[0]["user_id"] and row.streamed is False
    assert row.prompt_tokens == usage.input_tokens and row.completion_tokens == usage.output_tokens
    assert row.completion_sha256 == hashlib.sha256(response.output_text.encode()).hexdigest()

    # the wire format: output_text is the client's to compute; nothing is stored for retrieval
    raw = await client.post(
        "/v1/responses",
        json={"model": MODEL, "input": LONG_PROMPT, "max_output_tokens": 4, "temperature": 0},
        headers=_auth(author[1]),
    )
    assert raw.status_code == 200, raw.text
    data = raw.json()
    assert "output_text" not in data and data["store"] is False
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["output"][0]["status"] == "incomplete" and data["usage"]["output_tokens"] == 4


async def test_a_streamed_response_is_typed_events(sdk: openai.AsyncOpenAI, db_session: AsyncSession) -> None:
    stream = await sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=24, temperature=0, stream=True)
    events = [event async for event in stream]
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert deltas and types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        types[-1],
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in deltas)
    done = events[4 + len(deltas)]
    assert done.type == "response.output_text.done" and done.text == text
    final = events[-1]
    assert final.type in {"response.completed", "response.incomplete"}
    usage = final.response.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    row = await _record(db_session, final.response.id)
    cut = usage.output_tokens == 24 and row.finish_reason == "length"
    assert final.type == ("response.incomplete" if cut else "response.completed")
    assert final.response.output_text == text and final.response.status == final.type.removeprefix("response.")
    created = events[0]
    assert created.type == "response.created" and created.response.id == final.response.id
    assert created.response.status == "in_progress" and created.response.output == []
    assert row.streamed is True and row.completion_tokens == usage.output_tokens
    assert row.completion_sha256 == hashlib.sha256(text.encode()).hexdigest()

    # the client's stream helper checks the events' identities and order as it accumulates them
    async with sdk.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=24, temperature=0) as helper:
        helped = [event async for event in helper]
    assert [event.type for event in helped] == types
    assert helped[-1].response.output_text == text  # greedy and the same watermark: the same answer


async def test_the_sse_events_are_named(client: httpx.AsyncClient, author: Any) -> None:
    body = {"model": MODEL, "input": LONG_PROMPT, "max_output_tokens": 3, "temperature": 0, "stream": True}
    response = await client.post("/v1/responses", json=body, headers=_auth(author[1]))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in response.text.split("\n\n") if block.strip() and not block.startswith(":")]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")
    assert blocks[-1].startswith("event: response.incomplete")  # three tokens: cut; no [DONE] follows


async def test_instructions_and_a_conversation_are_chat_turns(
    client: httpx.AsyncClient, sdk: openai.AsyncOpenAI, author: Any
) -> None:
    """A list of messages with instructions generates what the equivalent chat request does:
    instructions first as a system turn, a developer turn as a system turn, replayed assistant
    output (with its id, status and annotations) as an assistant turn."""
    conversation: list[Any] = [
        {"role": "developer", "content": "Answer in a few words."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {
            "type": "message",
            "id": "msg_earlier",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Blue.", "annotations": []}],
        },
        {"type": "message", "role": "user", "content": "Another one?"},
    ]
    response = await sdk.responses.create(
        model=MODEL, instructions="You are terse.", input=conversation, max_output_tokens=16, temperature=0
    )
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "system", "content": "Answer in a few words."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"},
            ],
            "max_tokens": 16,
            "temperature": 0,
        },
        headers=_auth(author[1]),
    )
    assert chat.status_code == 200, chat.text
    assert response.output_text == chat.json()["choices"][0]["message"]["content"]
    assert response.usage is not None and response.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]
    assert response.instructions == "You are terse."


async def test_neutral_values_are_accepted(sdk: openai.AsyncOpenAI) -> None:
    """What clients send by default changes nothing, so it is accepted."""
    response = await sdk.responses.create(
        model=MODEL,
        input=PROMPT,
        max_output_tokens=2,
        store=False,
        tools=[],
        tool_choice="auto",
        parallel_tool_calls=True,
        include=[],
        text={"format": {"type": "text"}},
        truncation="disabled",
        user="end-user-7",
    )
    assert response.output_text and response.user == "end-user-7"


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_0123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"extra_body": {"max_tokens": 5}}, "max_tokens"),
    ({"extra_body": {"vllm_xargs": {"xmark_message": "0" * 32}}}, "vllm_xargs"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
        "input.0.content.0.type",
    ),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]}, "input.0.cache_control"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "param"), REFUSED)
async def test_refused_fields_are_named(
    sdk: openai.AsyncOpenAI, db_session: AsyncSession, fields: dict[str, Any], param: str, stream: bool
) -> None:
    before = await db_session.scalar(select(Generation.id).order_by(Generation.id.desc()).limit(1))
    request = {"model": MODEL, "input": PROMPT, "max_output_tokens": 2, "stream": stream, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.responses.create(**request)
    assert caught.value.status_code == 400
    assert caught.value.param == param and caught.value.code == "unsupported_parameter"
    body = caught.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    if param in {"store", "previous_response_id"}:
        assert "does not store" in body["message"]
    after = await db_session.scalar(select(Generation.id).order_by(Generation.id.desc()).limit(1))
    assert after == before  # refused before anything was generated or recorded


async def test_errors_name_this_endpoints_fields(
    app: Any, client: httpx.AsyncClient, author: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def post(**fields: Any) -> dict[str, Any]:
        response = await client.post(
            "/v1/responses", json={"model": MODEL, "input": PROMPT, **fields}, headers=_auth(author[1])
        )
        assert response.status_code in {400, 404, 422}, response.text
        return dict(response.json()["error"])

    limit = app.state.resources.settings.max_completion_tokens
    too_many = await post(max_output_tokens=limit + 1)
    assert too_many["param"] == "max_output_tokens" and too_many["code"] == "invalid_value"
    assert too_many["message"].startswith("max_output_tokens must be at most")
    monkeypatch.setattr(app.state.resources.settings, "max_prompt_chars", 10)
    too_long = await post(max_output_tokens=2)
    assert too_long["param"] == "input" and too_long["code"] == "context_length_exceeded"
    assert "messages" not in too_long["message"]
    monkeypatch.undo()
    assert (await post(model="gpt-4o"))["code"] == "model_not_found"
    assert (await post(input=[]))["param"] == "input"
    assert (await post(input=[{"content": "no role"}]))["param"] == "input.0.role"


async def test_a_response_needs_a_key(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/responses", json={"model": MODEL, "input": PROMPT})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


class _FailingStream:
    """A backend stream that fails after ``deltas`` deltas, as a worker that goes away would."""

    def __init__(self, inner: Any, deltas: int) -> None:
        self._inner = inner
        self._left = deltas

    @property
    def prompt_tokens(self) -> int:
        return int(self._inner.prompt_tokens)

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        self._inner.prompt_tokens = value

    def __aiter__(self) -> _FailingStream:
        return self

    async def __anext__(self) -> Any:
        if self._left == 0:
            self._inner.cancel()
            raise UpstreamUnavailableError("The model backend failed")
        self._left -= 1
        return await anext(self._inner)

    def cancel(self) -> None:
        self._inner.cancel()


async def test_a_failure_midway_ends_the_stream_with_response_failed(
    app: Any, sdk: openai.AsyncOpenAI, db_session: AsyncSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = app.state.resources.backend
    original = backend.stream

    async def failing(*args: Any, **kwargs: Any) -> _FailingStream:
        return _FailingStream(await original(*args, **kwargs), deltas=3)

    monkeypatch.setattr(backend, "stream", failing)
    stream = await sdk.responses.create(model=MODEL, input=PROMPT, max_output_tokens=40, temperature=0, stream=True)
    events = [event async for event in stream]
    final = events[-1]
    assert final.type == "response.failed"
    assert final.response.status == "failed" and final.response.error is not None
    assert final.response.error.code == "server_error" and "backend failed" in final.response.error.message
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.response.output_text == text
    row = await _record(db_session, final.response.id)
    assert row.finish_reason == "error"


async def test_a_response_is_traced_to_its_caller(
    client: httpx.AsyncClient, sdk: openai.AsyncOpenAI, db_session: AsyncSession, make_user: Any, author: Any
) -> None:
    """The watermark names the caller, and the generation record, under the response's id,
    corroborates it."""
    _, auditor = await make_user("auditor")
    # this endpoint takes no ``seed``: the request, alone in its batch, samples from the global
    # generator, seeded here (the backend reseeds it at random only after a seeded request)
    torch.manual_seed(20261204)
    for _ in range(3):  # an essay rarely ends early; long enough to name the caller
        response = await sdk.responses.create(model=MODEL, input=ESSAY, max_output_tokens=300, temperature=1.0)
        assert response.usage is not None
        if response.usage.output_tokens >= 180:
            break
    await _record(db_session, response.id)
    report = await client.post("/trace", json={"text": response.output_text}, headers=_auth(auditor))
    assert report.status_code == 200, report.text
    traced = report.json()
    assert traced["attribution"] is not None, traced["candidates"]
    assert traced["attribution"]["user_id"] == author[0]["user_id"]
    assert traced["corroboration"]["status"] == "corroborated"
    assert traced["corroboration"]["matches"][0]["request_id"] == response.id
