"""The official ``openai`` client against the gateway (local backend): every honoured field has its
effect, streamed and not; every refused field is a ``BadRequestError`` naming it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe the sea in one sentence."}]


@pytest.fixture
async def sdk(app: Any, make_user: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[openai.AsyncOpenAI]:
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"
    monkeypatch.setattr(app.state.resources.settings, "allow_logprobs", True)
    _, key = await make_user("user")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=key, base_url="http://testserver/v1", http_client=http) as client:
        yield client


async def _text(sdk: openai.AsyncOpenAI, stream: bool, **fields: Any) -> tuple[list[str], Any]:
    """The choices' texts and the usage, through the non-streamed or the streamed API."""
    if not stream:
        reply = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **fields)
        return [c.message.content or "" for c in reply.choices], reply.usage
    chunks = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **fields
    )
    texts: dict[int, str] = {}
    usage = None
    async for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        usage = chunk.usage or usage
    return [texts[i] for i in sorted(texts)], usage


@pytest.mark.parametrize("stream", [False, True])
async def test_honoured_fields_have_their_effect(sdk: openai.AsyncOpenAI, stream: bool) -> None:
    greedy, usage = await _text(sdk, stream, max_tokens=12, temperature=0)
    assert usage.completion_tokens <= 12 and greedy[0]
    # temperature 0 is deterministic; a tiny top_p keeps only the most likely token: the same text
    assert (await _text(sdk, stream, max_tokens=12, temperature=0))[0] == greedy
    assert (await _text(sdk, stream, max_tokens=12, temperature=1.0, top_p=1e-6))[0] == greedy
    # max_completion_tokens wins over max_tokens
    _, short = await _text(sdk, stream, max_tokens=12, max_completion_tokens=3, temperature=0)
    assert short.completion_tokens <= 3
    # n choices, each with the caller's watermark
    texts, _ = await _text(sdk, stream, max_tokens=6, n=3, temperature=1.0)
    assert len(texts) == 3
    # a seed makes sampling reproducible
    first, _ = await _text(sdk, stream, max_tokens=12, temperature=1.0, seed=1234)
    again, _ = await _text(sdk, stream, max_tokens=12, temperature=1.0, seed=1234)
    assert first == again
    # a stop string cuts the text before it
    stop = greedy[0].strip().split()[1]
    cut, _ = await _text(sdk, stream, max_tokens=12, temperature=0, stop=[stop])
    assert stop not in cut[0] and greedy[0].startswith(cut[0])
    # a field without effect on the output is accepted
    labelled, _ = await _text(sdk, stream, max_tokens=12, temperature=0, metadata={"case": "42"})
    assert labelled == greedy
    # ``user`` names an end user: its own message ID is the watermark, the same answer each time
    end_user, _ = await _text(sdk, stream, max_tokens=12, temperature=0, user="u-7")
    assert end_user == (await _text(sdk, stream, max_tokens=12, temperature=0, user="u-7"))[0]


async def test_logprobs_through_the_client(sdk: openai.AsyncOpenAI) -> None:
    reply = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 for entry in content)


REFUSED: list[tuple[str, Any]] = [
    ("tools", [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("reasoning_effort", "low"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("store", True),
]


@pytest.mark.parametrize(("field", "value"), REFUSED)
@pytest.mark.parametrize("stream", [False, True])
async def test_refused_fields_raise_bad_request_naming_them(
    sdk: openai.AsyncOpenAI, field: str, value: Any, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream, **{field: value})
    assert caught.value.param == field
    assert caught.value.code == "unsupported_parameter"
