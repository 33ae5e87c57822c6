"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the official
``anthropic`` client, on the real model and database: the message and its usage, the event stream
the client reads, stop reasons, the translation into chat (system blocks, cache breakpoints), the
refusals named in Anthropic's error envelope, the x-api-key header, limits and usage counted as for
chat, and the point of it all: a message's text is traced to its caller, with its generation
record (under the message's id) as the corroborating witness."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
import torch
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation, User
from tests.service.routers.test_responses import _FailingStream
from tests.service.trace.test_trace import ESSAY

# the traced answer and its verdict depend on the users' message IDs: drawn from a seeded generator
# (tests/service/conftest.py), with the sampling seeded (below), they give one outcome on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]

MODEL = "smollm2-135m-instruct"
PROMPT = "Name three colours."
HELLO = [{"role": "user", "content": PROMPT}]
# the client has no parameters for the sampling fields any more; the API (and the gateway) takes them
GREEDY = {"temperature": 0}


def _api_key(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


@pytest.fixture
async def author(make_user: Any, ready: None) -> tuple[dict[str, Any], str]:
    return await make_user("user", "messages-author")


def _client(app: Any, **credentials: Any) -> anthropic.AsyncAnthropic:
    # the client's own HTTP package (httpx2), over the app in this process
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://testserver")
    return anthropic.AsyncAnthropic(base_url="http://testserver", http_client=http, max_retries=0, **credentials)


@pytest.fixture
async def sdk(app: Any, author: tuple[dict[str, Any], str]) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The client authenticating as Anthropic's own clients do: ``x-api-key``."""
    async with _client(app, api_key=None, auth_token=None, default_headers={"x-api-key": author[1]}) as client:
        yield client


async def _records(session: AsyncSession, request_id: str) -> list[Generation]:
    """The generation rows of ``request_id``; they are written as the response ends, so wait for one."""
    for _ in range(100):
        rows = list(await session.scalars(select(Generation).where(Generation.request_id == request_id)))
        if rows:
            return rows
        await asyncio.sleep(0.05)
    raise AssertionError(f"no generation record for {request_id}")


async def _latest_generation(session: AsyncSession) -> int | None:
    return await session.scalar(select(Generation.id).order_by(Generation.id.desc()).limit(1))


async def _post(
    client: httpx.AsyncClient, key: str, body: dict[str, Any], path: str = "/v1/messages"
) -> httpx.Response:
    return await client.post(path, json=body, headers=_api_key(key))


def _anthropic_error(response: httpx.Response, status: int, type_: str) -> str:
    """The message of an error answered in Anthropic's envelope (and nothing else in it)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == type_, body
    return str(body["error"]["message"])


async def test_a_message_is_returned_and_recorded_once(
    sdk: anthropic.AsyncAnthropic, db_session: AsyncSession, author: Any
) -> None:
    message = await sdk.messages.create(
        model=MODEL, max_tokens=20, messages=HELLO, extra_body=GREEDY, metadata={"user_id": "end-user-7"}
    )
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text.strip()
    assert message.stop_reason in {"end_turn", "max_tokens"} and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 20
    assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens == 0

    [row] = await _records(db_session, message.id)  # exactly one record, under the message's id
    assert row.user_id == author[0]["user_id"] and row.streamed is False and row.model == MODEL
    assert row.prompt_tokens == usage.input_tokens and row.completion_tokens == usage.output_tokens
    assert row.completion_sha256 == hashlib.sha256(block.text.encode()).hexdigest()
    # cut by the budget only when it used all of it (an end token can also fall on the last place)
    expected = "max_tokens" if row.finish_reason == "length" else "end_turn"
    assert message.stop_reason == expected


async def test_a_bearer_token_authenticates_too(app: Any, author: Any) -> None:
    async with _client(app, api_key=author[1]) as client:
        message = await client.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


async def test_a_streamed_message_is_anthropics_events(
    sdk: anthropic.AsyncAnthropic, db_session: AsyncSession, author: Any
) -> None:
    stream = await sdk.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY, stream=True)
    events = [event async for event in stream]
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "content_block_delta"]
    assert deltas and types == [  # the client passes over the ping (test_the_sse_events_are_named)
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]
    assert start.type == "message_start" and start.message.id.startswith("msg_")
    assert start.message.content == [] and start.message.stop_reason is None
    assert start.message.usage.input_tokens > 0
    block_start = events[1]
    assert block_start.type == "content_block_start" and block_start.index == 0
    assert block_start.content_block.type == "text"
    text = ""
    for delta in deltas:
        assert delta.type == "content_block_delta" and delta.index == 0 and delta.delta.type == "text_delta"
        text += delta.delta.text
    final = events[-2]
    assert final.type == "message_delta" and 0 < final.usage.output_tokens <= 24
    [row] = await _records(db_session, start.message.id)
    assert row.user_id == author[0]["user_id"] and row.streamed is True
    assert row.completion_tokens == final.usage.output_tokens
    assert row.completion_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert final.delta.stop_reason == ("max_tokens" if row.finish_reason == "length" else "end_turn")

    # the client's stream helper accumulates the events into the message, as it would Anthropic's
    async with sdk.messages.stream(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY) as helper:
        helped = await helper.get_final_message()
    [block] = helped.content
    assert block.type == "text" and block.text == text  # greedy and the same watermark: the same answer
    assert helped.stop_reason == final.delta.stop_reason and helped.usage.output_tokens == final.usage.output_tokens
    assert helped.usage.input_tokens == start.message.usage.input_tokens


async def test_the_sse_events_are_named(client: httpx.AsyncClient, author: Any) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True}
    response = await _post(client, author[1], body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in response.text.split("\n\n") if block.strip() and not block.startswith(":")]
    names = []
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        names.append(event.removeprefix("event: "))
        assert json.loads(data.removeprefix("data: "))["type"] == names[-1]
    assert names[:4] == ["message_start", "content_block_start", "ping", "content_block_delta"]
    assert blocks[-2].startswith("event: message_delta") and '"stop_reason":"max_tokens"' in blocks[-2]
    assert blocks[-1].startswith("event: message_stop")  # no [DONE] follows


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_sequence_ends_the_message(sdk: anthropic.AsyncAnthropic, stream: bool) -> None:
    """A stop sequence the answer reaches: the text is cut before it, and the message says which."""
    whole = await sdk.messages.create(model=MODEL, max_tokens=30, messages=HELLO, extra_body=GREEDY)
    text = whole.content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert len(words) >= 4, text
    stop = words[3]
    expected = text[: text.find(stop)]
    other = "\u2603 never"  # a second one that is never produced
    if stream:
        async with sdk.messages.stream(
            model=MODEL, max_tokens=30, messages=HELLO, extra_body=GREEDY, stop_sequences=[other, stop]
        ) as helper:
            message = await helper.get_final_message()
    else:
        message = await sdk.messages.create(
            model=MODEL, max_tokens=30, messages=HELLO, extra_body=GREEDY, stop_sequences=[other, stop]
        )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == expected  # type: ignore[union-attr]


async def test_system_blocks_with_cache_breakpoints_are_a_system_turn(
    client: httpx.AsyncClient, sdk: anthropic.AsyncAnthropic, author: Any
) -> None:
    """``system`` as text blocks (with ``cache_control``), and text blocks of a conversation,
    generate what the equivalent chat request does."""
    message = await sdk.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        system=[
            {"type": "text", "text": "You are terse. "},
            {"type": "text", "text": "Answer in a few words.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
            {"role": "user", "content": "Another one?"},
        ],
    )
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are terse. Answer in a few words."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"},
            ],
            "max_tokens": 16,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {author[1]}"},
    )
    assert chat.status_code == 200, chat.text
    assert message.content[0].text == chat.json()["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert message.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]
    assert message.usage.cache_read_input_tokens == 0  # nothing was cached


async def test_count_tokens_counts_the_prompt_as_the_message_does(
    client: httpx.AsyncClient, sdk: anthropic.AsyncAnthropic, author: Any, db_session: AsyncSession
) -> None:
    before = await _latest_generation(db_session)
    system = "You are a helpful assistant."
    counted = await sdk.messages.count_tokens(model=MODEL, system=system, messages=HELLO)
    assert await _latest_generation(db_session) == before  # nothing generated or recorded
    message = await sdk.messages.create(model=MODEL, system=system, messages=HELLO, max_tokens=2)
    assert counted.input_tokens == message.usage.input_tokens > 0
    chat = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "system", "content": system}, *HELLO], "max_tokens": 1},
        headers={"Authorization": f"Bearer {author[1]}"},
    )
    assert chat.json()["usage"]["prompt_tokens"] == counted.input_tokens

    # a generation's settings are not part of a prompt
    response = await _post(client, author[1], {"model": MODEL, "messages": HELLO, "max_tokens": 5}, COUNT)
    assert "'max_tokens'" in _anthropic_error(response, 400, "invalid_request_error")
    response = await _post(client, author[1], {"model": "claude-sonnet-4-5", "messages": HELLO}, COUNT)
    assert "claude-sonnet-4-5" in _anthropic_error(response, 404, "not_found_error")


COUNT = "/v1/messages/count_tokens"

# (fields replacing or joining a valid body, what the message must name)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"stop": ["x"]}, "stop_sequences"),  # chat's name, with this route's
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"vllm_xargs": {"xmark_message": "0" * 32}}, "vllm_xargs"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": 5}, "top_k"),  # the local backend samples from the whole vocabulary
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"metadata": {"user_id": "u", "session": "s"}}, "metadata.session"),
    ({"tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}, "tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    (
        {
            "messages": [
                {"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}]},
            ]
        },
        "messages.1.content.0.type",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
                    ],
                }
            ]
        },
        "messages.0.content.0.type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": 1}]}]}, "extra"),
    ({"system": [{"type": "document", "source": {}}]}, "system.0.type"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Red,"}]}, "messages.1.role"),
]


@pytest.mark.parametrize(("fields", "named"), REFUSED)
async def test_refusals_are_named_in_anthropics_envelope(
    client: httpx.AsyncClient, author: Any, db_session: AsyncSession, fields: dict[str, Any], named: str
) -> None:
    before = await _latest_generation(db_session)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields}
    body = {name: value for name, value in body.items() if value is not None}
    for stream in (False, True):
        response = await _post(client, author[1], {**body, "stream": stream})
        assert named in _anthropic_error(response, 400, "invalid_request_error")
    assert await _latest_generation(db_session) == before  # refused before anything was generated


async def test_the_sdk_raises_its_own_errors(app: Any, sdk: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        await sdk.messages.create(model=MODEL, max_tokens=2, messages=HELLO, extra_body={"top_k": 5})
    assert bad.value.status_code == 400 and "top_k" in bad.value.message
    assert isinstance(bad.value.body, dict) and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        await sdk.messages.create(model="claude-opus-4-1", max_tokens=2, messages=HELLO)
    assert missing.value.status_code == 404
    async with _client(app, api_key=None, default_headers={"x-api-key": "xm_not-a-key"}) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await stranger.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert refused.value.status_code == 401
    assert "xm_not-a-key" not in str(refused.value.body)


async def test_keys_are_checked_first_and_never_echoed(client: httpx.AsyncClient, author: Any) -> None:
    malformed = "xm_" + "A" * 43 + "_AAAAAA"  # well-shaped, bad checksum
    cases = [
        {},  # no key
        {"x-api-key": "sk-ant-api03-not-ours"},
        {"x-api-key": malformed},
        {"Authorization": "Bearer sk-ant-api03-not-ours"},
        {"x-api-key": author[1], "Authorization": f"Bearer {malformed}"},  # two keys that differ
    ]
    for headers in cases:
        for path in ("/v1/messages", COUNT):
            response = await client.post(path, content=b"{not json", headers=headers)  # 401 before the body
            message = _anthropic_error(response, 401, "authentication_error")
            assert "not-ours" not in message and malformed not in message and author[1] not in message
    # a body that is not JSON, from an authenticated caller: 400, not 422
    json_body = {**_api_key(author[1]), "Content-Type": "application/json"}
    response = await client.post("/v1/messages", content=b"{not json", headers=json_body)
    assert "JSON" in _anthropic_error(response, 400, "invalid_request_error")
    # the same key in both headers is one key
    both = {**_api_key(author[1]), "Authorization": f"Bearer {author[1]}"}
    ok = await client.post("/v1/messages", json={"model": MODEL, "messages": HELLO, "max_tokens": 1}, headers=both)
    assert ok.status_code == 200, ok.text


async def test_other_routes_keep_the_openai_envelope(app: Any, client: httpx.AsyncClient, author: Any) -> None:
    """x-api-key is this route's: chat answers 401 to it, in OpenAI's envelope, and its 422 stays."""
    chat = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": HELLO}, headers=_api_key(author[1])
    )
    assert chat.status_code == 401 and set(chat.json()["error"]) == {"message", "type", "param", "code"}
    invalid = await client.post(
        "/v1/chat/completions", json={"model": MODEL}, headers={"Authorization": f"Bearer {author[1]}"}
    )
    assert invalid.status_code == 422 and invalid.json()["error"]["param"] == "messages"
    wrong_method = await client.get("/v1/messages", headers=_api_key(author[1]))
    _anthropic_error(wrong_method, 405, "invalid_request_error")
    # refused by the body's declared length, before any route runs: still this route's envelope
    too_large = b"x" * (app.state.resources.settings.max_body_bytes + 1)
    for path in ("/v1/messages", "/v1/chat/completions"):
        response = await client.post(path, content=too_large, headers=_api_key(author[1]))
        assert response.status_code == 413
        if path == "/v1/messages":
            _anthropic_error(response, 413, "request_too_large")
        else:
            assert response.json()["error"]["code"] == "payload_too_large"


async def test_limits_and_usage_count_messages_as_chat(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, db_session: AsyncSession, ready: None
) -> None:
    principal, key = await make_user("user")
    await db_session.execute(update(User).where(User.id == principal["user_id"]).values(requests_per_minute=2))
    await db_session.commit()
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    first = await _post(client, key, body)
    second = await _post(client, key, {**body, "stream": True})
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    third = await _post(client, key, body)
    assert "2 requests per minute" in _anthropic_error(third, 429, "rate_limit_error")
    assert int(third.headers["Retry-After"]) >= 1

    await _records(db_session, first.json()["id"])
    for _ in range(100):  # the stream's record is written as it ends
        count = await db_session.scalar(
            select(func.count()).select_from(Generation).where(Generation.user_id == principal["user_id"])
        )
        if count == 2:
            break
        await asyncio.sleep(0.05)
    usage = await client.get(
        f"/admin/usage?user_id={principal['user_id']}", headers={"Authorization": f"Bearer {admin_key}"}
    )
    [day] = usage.json()["data"]
    assert day["requests"] == 2 and day["completion_tokens"] == 4
    assert day["prompt_tokens"] == 2 * first.json()["usage"]["input_tokens"]


async def test_a_failure_midway_ends_the_stream_with_an_error_event(
    app: Any, client: httpx.AsyncClient, author: Any, db_session: AsyncSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = app.state.resources.backend
    original = backend.stream

    async def failing(*args: Any, **kwargs: Any) -> _FailingStream:
        return _FailingStream(await original(*args, **kwargs), deltas=3)

    monkeypatch.setattr(backend, "stream", failing)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 40, "stream": True, **GREEDY}
    response = await _post(client, author[1], body)
    assert response.status_code == 200
    events = [block for block in response.text.split("\n\n") if block.strip() and not block.startswith(":")]
    name, data = events[-1].split("\n")
    assert name == "event: error"
    error = json.loads(data.removeprefix("data: "))
    # the backend's 503 is Anthropic's overloaded_error, in its envelope
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "The model backend failed"}}
    start = json.loads(events[0].split("\n")[1].removeprefix("data: "))
    [row] = await _records(db_session, start["message"]["id"])
    assert row.finish_reason == "error" and row.streamed is True


async def test_a_message_is_traced_to_its_caller(
    client: httpx.AsyncClient, sdk: anthropic.AsyncAnthropic, db_session: AsyncSession, make_user: Any, author: Any
) -> None:
    """The watermark names the caller, and the generation record, under the message's id,
    corroborates it."""
    _, auditor = await make_user("auditor")
    # this endpoint takes no ``seed``: the request, alone in its batch, samples from the global
    # generator, seeded here (the backend reseeds it at random only after a seeded request)
    torch.manual_seed(20261205)
    for _ in range(3):  # an essay rarely ends early; long enough to name the caller
        async with sdk.messages.stream(
            model=MODEL, max_tokens=300, messages=[{"role": "user", "content": ESSAY}], extra_body={"temperature": 1.0}
        ) as stream:
            message = await stream.get_final_message()
        if message.usage.output_tokens >= 150:
            break
    assert message.usage.output_tokens >= 100
    [row] = await _records(db_session, message.id)
    assert row.user_id == author[0]["user_id"]
    text = message.content[0].text  # type: ignore[union-attr]
    report = await client.post("/trace", json={"text": text}, headers={"Authorization": f"Bearer {auditor}"})
    assert report.status_code == 200, report.text
    traced = report.json()
    assert traced["attribution"] is not None, traced["candidates"]
    assert traced["attribution"]["user_id"] == author[0]["user_id"]
    assert traced["corroboration"]["status"] == "corroborated"
    assert traced["corroboration"]["matches"][0]["request_id"] == message.id


# -- the translation of tool calls (what a vLLM worker streams), without a model ------------------


def _chunk(prepared: Any, **choice: Any) -> Any:
    from service.schemas.chat import ChatCompletionChunk, ChunkChoice, ChunkDelta

    finish = choice.pop("finish_reason", None)
    return ChatCompletionChunk(
        id=prepared.request_id,
        created=0,
        model=MODEL,
        choices=[ChunkChoice(index=0, delta=ChunkDelta(**choice), finish_reason=finish)],
    )


def test_streamed_tool_calls_are_tool_use_blocks() -> None:
    from types import SimpleNamespace

    from service.routers.messages import MessageEvents
    from service.schemas.chat import ChatCompletionChunk, Usage

    prepared = SimpleNamespace(request_id="msg_0", model=MODEL)
    events = MessageEvents(prepared, SimpleNamespace(prompt_tokens=11))  # type: ignore[arg-type]
    out = events.chunk(_chunk(prepared, role="assistant", content=""))
    out += events.chunk(_chunk(prepared, content="Let me look."))
    # the first call's name comes after its first piece; the second call follows it
    out += events.chunk(_chunk(prepared, tool_calls=[{"index": 0, "id": "call_a", "function": {"arguments": ""}}]))
    out += events.chunk(_chunk(prepared, tool_calls=[{"index": 0, "function": {"name": "w", "arguments": '{"ci'}}]))
    out += events.chunk(_chunk(prepared, tool_calls=[{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]))
    out += events.chunk(_chunk(prepared, tool_calls=[{"index": 1, "id": "call_b", "function": {"name": "v"}}]))
    out += events.chunk(_chunk(prepared, finish_reason="tool_calls"))
    usage = Usage(prompt_tokens=11, completion_tokens=9, total_tokens=20)
    out += events.chunk(ChatCompletionChunk(id="msg_0", created=0, model=MODEL, choices=[], usage=usage))
    out += events.ended()
    payloads = [event.model_dump(mode="json") for event in out]
    assert [p["type"] for p in payloads] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert payloads[0]["message"]["usage"] == {
        "input_tokens": 11,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    assert payloads[5]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "w", "input": {}}
    assert [p["delta"]["partial_json"] for p in payloads[6:8]] == ['{"ci', 'ty": "Paris"}']
    assert payloads[9]["index"] == 2 and payloads[9]["content_block"]["name"] == "v"
    assert payloads[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert payloads[-2]["usage"] == {"input_tokens": 11, "output_tokens": 9}


def test_a_whole_answers_tool_calls_are_tool_use_blocks() -> None:
    from types import SimpleNamespace

    from service.routers.messages import completed_message
    from service.schemas.chat import AssistantMessage, ChatCompletion, Choice, Usage

    def answer(arguments: str, finish: str) -> dict[str, Any]:
        call = {"id": "call_a", "type": "function", "function": {"name": "w", "arguments": arguments}}
        completion = ChatCompletion(
            id="msg_1",
            created=0,
            model=MODEL,
            choices=[Choice(index=0, message=AssistantMessage(content=None, tool_calls=[call]), finish_reason=finish)],
            usage=Usage(prompt_tokens=5, completion_tokens=7, total_tokens=12),
        )
        prepared = SimpleNamespace(request_id="msg_1", model=MODEL)
        return completed_message(prepared, completion).model_dump(mode="json")  # type: ignore[arg-type]

    whole = answer('{"city": "Paris"}', "tool_calls")
    assert whole["content"] == [{"type": "tool_use", "id": "call_a", "name": "w", "input": {"city": "Paris"}}]
    assert whole["stop_reason"] == "tool_use" and whole["usage"]["output_tokens"] == 7
    # cut by the budget: what was written, as text (the stop reason says why it is not whole)
    cut = answer('{"city": "Pa', "length")
    assert cut["content"][0]["input"] == '{"city": "Pa' and cut["stop_reason"] == "max_tokens"


def test_a_tool_use_input_round_trips_as_the_gateway_returned_it() -> None:
    """What ``completed_message`` answers as ``input`` (an object, or the arguments' text when the
    model's were not JSON) is taken back unchanged; any other value is refused naming its place."""
    from service.errors import InvalidRequestError
    from service.routers.messages import _tool_call
    from service.schemas.messages import ContentBlock

    def call(value: Any) -> dict[str, Any]:
        block = ContentBlock.model_validate({"type": "tool_use", "id": "call_a", "name": "w", "input": value})
        return _tool_call(block, "messages.1.content.0")

    assert call({"city": "Paris"})["function"]["arguments"] == '{"city": "Paris"}'
    assert call('{"city": "Pa')["function"]["arguments"] == '{"city": "Pa'
    for value in (3, [1], True):
        with pytest.raises(InvalidRequestError) as refused:
            call(value)
        assert refused.value.param == "messages.1.content.0.input"
        assert "must be an object" in str(refused.value)
