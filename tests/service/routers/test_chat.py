"""POST /v1/chat/completions and GET /v1/models against the real model and database."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.backends.local import LocalBackend
from service.models import Generation
from service.schemas.chat import ChatCompletionRequest
from service.schemas.common import MessageIdOut, Principal
from service.services.generation import GenerationService

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"


@pytest.fixture
async def user_key(make_user: Any, ready: None) -> tuple[dict[str, Any], str]:
    return await make_user("user")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _generation_count(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.count()).select_from(Generation)) or 0)


def _body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(overrides)
    return body


async def test_models_lists_the_served_model(client: httpx.AsyncClient, user_key: Any) -> None:
    response = await client.get("/v1/models", headers=_auth(user_key[1]))
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [MODEL]
    assert data["data"][0]["object"] == "model"


async def test_models_requires_a_key(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


async def test_completion_is_returned_and_recorded(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, user_key: Any
) -> None:
    principal, key = user_key
    metrics = app.state.resources.metrics
    completion_counter = metrics.tokens_generated.labels(kind="completion", model=MODEL)
    prompt_counter = metrics.tokens_generated.labels(kind="prompt", model=MODEL)
    counted = (completion_counter._value.get(), prompt_counter._value.get())
    before = await _generation_count(db_session)
    response = await client.post("/v1/chat/completions", json=_body(), headers=_auth(key))
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == MODEL
    [choice] = data["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    text = choice["message"]["content"]
    assert text
    assert choice["finish_reason"] in {"stop", "length"}
    usage = data["usage"]
    assert usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert response.headers["content-type"] == "application/json"
    # the model's share of the request and the gateway's time until the response started
    timings = dict(entry.split(";dur=") for entry in response.headers.get_list("server-timing", split_commas=True))
    assert set(timings) == {"model", "app"}
    assert 0 < float(timings["model"]) < float(timings["app"])

    assert await _generation_count(db_session) == before + 1
    row = (await db_session.scalars(select(Generation).where(Generation.request_id == data["id"]))).one()
    assert row.user_id == principal["user_id"]
    assert row.key_version_id == app.state.resources.keyring.active().id
    assert row.model == MODEL
    assert row.streamed is False
    assert row.prompt_tokens == usage["prompt_tokens"]
    assert row.completion_tokens == usage["completion_tokens"]
    assert row.finish_reason == choice["finish_reason"]
    assert row.completion_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert row.completion_text is None  # retain_completions is off by default
    assert completion_counter._value.get() == counted[0] + usage["completion_tokens"]
    assert prompt_counter._value.get() == counted[1] + usage["prompt_tokens"]
    assert metrics.generations.labels(finish_reason=choice["finish_reason"], model=MODEL)._value.get() >= 1


async def test_max_completion_tokens_limits_the_output(client: httpx.AsyncClient, user_key: Any) -> None:
    body = _body(max_completion_tokens=3, temperature=0.9)
    del body["max_tokens"]
    body["messages"] = [{"role": "user", "content": "Write a long story about the sea."}]
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == 3
    assert data["choices"][0]["finish_reason"] == "length"


async def test_content_parts_system_and_assistant_turns(client: httpx.AsyncClient, user_key: Any) -> None:
    body = _body(
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Say goodbye."},
        ]
    )
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


async def test_n_choices_seed_reproducible_and_each_recorded(
    client: httpx.AsyncClient, db_session: AsyncSession, user_key: Any
) -> None:
    body = _body(n=3, temperature=1.0, seed=1234, max_tokens=12)
    body["messages"] = [{"role": "user", "content": "Tell me about cats."}]
    before = await _generation_count(db_session)
    first = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    second = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    assert first.status_code == second.status_code == 200
    texts = [c["message"]["content"] for c in first.json()["choices"]]
    assert [c["index"] for c in first.json()["choices"]] == [0, 1, 2]
    assert texts == [c["message"]["content"] for c in second.json()["choices"]]
    assert len(set(texts)) > 1  # sampling, not three copies of one row
    assert await _generation_count(db_session) == before + 6
    usage = first.json()["usage"]
    rows = (await db_session.scalars(select(Generation).where(Generation.request_id == first.json()["id"]))).all()
    assert sorted(r.completion_sha256 for r in rows) == sorted(hashlib.sha256(t.encode()).hexdigest() for t in texts)
    assert sum(r.completion_tokens for r in rows) == usage["completion_tokens"]


async def test_stop_string_cuts_the_output(client: httpx.AsyncClient, user_key: Any) -> None:
    body = _body(max_tokens=30)
    body["messages"] = [{"role": "user", "content": "Write a sentence about the moon."}]
    full = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    text = full.json()["choices"][0]["message"]["content"]
    words = text.split()
    assert len(words) > 4, text
    stop = " " + words[3]
    cut = text.index(stop)
    stopped = await client.post(
        "/v1/chat/completions", json={**body, "stop": [stop, "\u2603never"]}, headers=_auth(user_key[1])
    )
    choice = stopped.json()["choices"][0]
    assert choice["message"]["content"] == text[:cut]
    assert choice["finish_reason"] == "stop"


async def test_streaming_sse_format_usage_and_record(
    client: httpx.AsyncClient, db_session: AsyncSession, user_key: Any
) -> None:
    principal, key = user_key
    before = await _generation_count(db_session)
    body = _body(stream=True, stream_options={"include_usage": True}, max_tokens=10)
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = (await response.aread()).decode()
    events = [block for block in raw.split("\n\n") if block.strip()]
    assert all(block.startswith("data: ") for block in events), raw
    payloads = [block[len("data: ") :] for block in events]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    finish = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert len(finish) == 1 and finish[0]["finish_reason"] in {"stop", "length"}
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text
    assert usage_chunk["usage"]["completion_tokens"] <= 10
    row = (await db_session.scalars(select(Generation).where(Generation.request_id == chunks[0]["id"]))).one()
    assert await _generation_count(db_session) == before + 1
    assert row.streamed is True
    assert row.user_id == principal["user_id"]
    assert row.completion_tokens == usage_chunk["usage"]["completion_tokens"]
    assert row.completion_sha256 == hashlib.sha256(text.encode()).hexdigest()


async def test_streaming_without_usage_has_no_usage_field(client: httpx.AsyncClient, user_key: Any) -> None:
    body = _body(stream=True, max_tokens=4)
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(user_key[1])) as response:
        raw = (await response.aread()).decode()
    payloads = [b[len("data: ") :] for b in raw.split("\n\n") if b.strip()]
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in json.loads(p) for p in payloads[:-1])


async def test_retained_completion_text(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, user_key: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.state.resources.settings, "retain_completions", True)
    response = await client.post("/v1/chat/completions", json=_body(), headers=_auth(user_key[1]))
    data = response.json()
    row = (await db_session.scalars(select(Generation).where(Generation.request_id == data["id"]))).one()
    assert row.completion_text == data["choices"][0]["message"]["content"]


def _long_prompt(settings: Any) -> str:
    return "x" * (settings.max_prompt_chars + 1)


BAD_BODIES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("empty messages", {"messages": []}, 422, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 422, "messages.0.role"),
    ("tool turn without its call's id", {"messages": [{"role": "tool", "content": "hi"}]}, 422, "messages.0"),
    (
        "tool_call_id on a user turn",
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
        422,
        "messages.0",
    ),
    ("null content without tool calls", {"messages": [{"role": "assistant", "content": None}]}, 422, "messages.0"),
    (
        "empty tool_calls",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        422,
        "messages.0.tool_calls",
    ),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        422,
        None,
    ),
    ("zero max_tokens", {"max_tokens": 0}, 422, "max_tokens"),
    ("negative max_tokens", {"max_tokens": -5}, 422, "max_tokens"),
    ("huge max_tokens", {"max_tokens": 10**6}, 400, "max_tokens"),
    ("huge max_completion_tokens", {"max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("temperature above 2", {"temperature": 2.5}, 422, "temperature"),
    ("top_p zero", {"top_p": 0}, 422, "top_p"),
    ("n above 8", {"n": 9}, 422, "n"),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, 422, "stop"),
    ("unknown model", {"model": "gpt-4o"}, 404, "model"),
    ("missing model", {"model": None}, 422, "model"),
]


@pytest.mark.parametrize(("case", "overrides", "status", "param"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
async def test_bad_requests_get_an_envelope_and_write_nothing(
    client: httpx.AsyncClient,
    db_session: AsyncSession,
    user_key: Any,
    case: str,
    overrides: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    body = {k: v for k, v in {**_body(), **overrides}.items() if v is not None}
    before = await _generation_count(db_session)
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] in {"invalid_request_error", "not_found_error"}
    if param is not None:
        assert error["param"] == param
    assert await _generation_count(db_session) == before


async def test_prompt_over_the_character_limit_is_rejected(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, user_key: Any
) -> None:
    before = await _generation_count(db_session)
    body = _body(messages=[{"role": "user", "content": _long_prompt(app.state.resources.settings)}])
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(user_key[1]))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert await _generation_count(db_session) == before


async def test_missing_key_writes_nothing(client: httpx.AsyncClient, db_session: AsyncSession) -> None:
    before = await _generation_count(db_session)
    response = await client.post("/v1/chat/completions", json=_body())
    assert response.status_code == 401
    assert await _generation_count(db_session) == before


async def test_backend_not_ready_is_503(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, user_key: Any, tmp_path: Any
) -> None:
    loading = LocalBackend(tmp_path / "no-model", MODEL)  # never started: not ready
    original = app.state.resources.backend
    app.state.resources.backend = loading
    try:
        before = await _generation_count(db_session)
        response = await client.post("/v1/chat/completions", json=_body(), headers=_auth(user_key[1]))
    finally:
        app.state.resources.backend = original
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "not_ready"
    assert await _generation_count(db_session) == before


async def test_client_cannot_choose_the_watermark(
    client: httpx.AsyncClient, user_key: Any, db_session: AsyncSession
) -> None:
    before = await _generation_count(db_session)
    for field, value in (
        ("vllm_xargs", {"xmark_message": "0" * 16, "xmark_disable": True}),
        ("watermarking", {"enabled": False, "message": "1" * 16}),
    ):
        response = await client.post("/v1/chat/completions", json=_body(**{field: value}), headers=_auth(user_key[1]))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported_parameter", field)
        assert "watermark" in error["message"]
    assert await _generation_count(db_session) == before


async def test_the_watermark_is_the_callers(app: Any, user_key: Any) -> None:
    principal, _ = user_key
    body = ChatCompletionRequest.model_validate(_body())
    caller = Principal(
        user_id=principal["user_id"],
        name=principal["name"],
        role="user",
        api_key_id=1,
        message_ids=tuple(MessageIdOut(**m) for m in principal["message_ids"]),
    )
    service = GenerationService(
        app.state.resources.generation_records,
        app.state.resources.settings,
        app.state.resources.backend,
        app.state.resources.keyring,
        app.state.resources.metrics,
    )
    prepared = service.prepare(caller, body)
    assert prepared.stamp.message.bits == principal["message_id"]
    assert prepared.stamp.key.fingerprint == app.state.resources.keyring.active().key.fingerprint
