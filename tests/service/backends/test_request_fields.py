"""No request field is ignored silently: each is honoured by the backend, has no effect on the
output, is sent at its neutral value, or is refused with 400 ``unsupported_parameter`` naming it."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.backends.local import LocalBackend
from service.errors import InvalidRequestError
from service.models import Generation
from service.services.request_fields import DEFAULT_HONOURED, refuse_unhonoured

MODEL = "smollm2-135m-instruct"

# each changes the output and the local backend does not honour it (logprobs: not under the
# default XMARK_ALLOW_LOGPROBS=false); the vLLM backend honours most of them
REFUSED = [
    ("logprobs", True),
    ("top_logprobs", 3),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("top_k", 5),
    ("min_p", 0.1),
    ("reasoning_effort", "low"),
    ("store", True),
    ("max_token", 5),  # a typo of max_tokens: unknown, refused rather than unlimited
]
# honoured by both backends (the local one: service.backends.penalties), refused by one that does not
PENALTIES = [
    ("presence_penalty", 0.5),
    ("frequency_penalty", -0.2),
    ("logit_bias", {"42": 5}),
]
# sent at the value that means "off": nothing to honour
NEUTRAL = [
    ("logprobs", False),
    ("top_logprobs", 0),
    ("tools", []),
    ("tool_choice", "none"),
    ("response_format", {"type": "text"}),
    ("presence_penalty", 0),
    ("frequency_penalty", 0.0),
    ("logit_bias", {}),
    ("top_k", -1),
    ("min_p", 0),
    ("store", False),
    ("parallel_tool_calls", True),
]


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
        **fields,
    }


async def _generations(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.count()).select_from(Generation)) or 0)


@pytest.mark.parametrize(("field", "value"), REFUSED + PENALTIES)
def test_policy_refuses_what_changes_the_output(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        refuse_unhonoured({"model": MODEL, field: value}, DEFAULT_HONOURED, "local")
    assert caught.value.param == field
    assert caught.value.code == "unsupported_parameter"
    assert field in caught.value.message


@pytest.mark.parametrize(("field", "value"), NEUTRAL)
def test_policy_accepts_neutral_values(field: str, value: Any) -> None:
    refuse_unhonoured({field: value}, DEFAULT_HONOURED, "local")


def test_policy_honours_what_the_backend_declares() -> None:
    refuse_unhonoured({"top_k": 5}, DEFAULT_HONOURED | {"top_k"}, "vllm")
    refuse_unhonoured(dict(PENALTIES), LocalBackend.honoured_fields, "local")
    refuse_unhonoured({"user": "alice", "metadata": {"team": "a"}}, DEFAULT_HONOURED, "local")
    with pytest.raises(InvalidRequestError, match="vllm backend"):
        refuse_unhonoured({"min_p": 0.2}, DEFAULT_HONOURED | {"top_k"}, "vllm")


def test_true_is_not_a_neutral_one() -> None:
    # True == 1 in Python: top_logprobs=True must not pass as top_logprobs=1, nor logprobs=1 as True
    with pytest.raises(InvalidRequestError):
        refuse_unhonoured({"top_logprobs": True}, DEFAULT_HONOURED, "local")
    with pytest.raises(InvalidRequestError):
        refuse_unhonoured({"logprobs": 1}, DEFAULT_HONOURED, "local")


@pytest.mark.parametrize(("field", "value"), REFUSED)
async def test_refused_fields_are_400_and_generate_nothing(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession, field: str, value: Any
) -> None:
    _, key = await make_user("user")
    before = await _generations(db_session)
    response = await client.post(
        "/v1/chat/completions", json=_chat(**{field: value}), headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unsupported_parameter", field)
    assert await _generations(db_session) == before


@pytest.mark.parametrize(
    ("message", "param"),
    [
        # turns of a tool-using conversation, on a backend that cannot render tools
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            "messages.0.tool_calls",
        ),
        ({"role": "tool", "content": "42", "tool_call_id": "c1"}, "messages.0.role"),
        ({"role": "user", "content": "x", "refusal": "no"}, "messages.0.refusal"),
        (
            {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]},
            "messages.0.content.0.cache_control",
        ),
    ],
)
async def test_unread_message_fields_are_refused(
    client: httpx.AsyncClient, make_user: Any, message: dict[str, Any], param: str
) -> None:
    _, key = await make_user("user")
    body = _chat(messages=[message, {"role": "user", "content": "hi"}])
    response = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("unsupported_parameter", param)


async def test_neutral_values_are_served(
    app: Any, client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession
) -> None:
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"
    _, key = await make_user("user")
    before = await _generations(db_session)
    body = _chat(**dict(NEUTRAL), user="alice", metadata={"ticket": "7"})
    response = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in {"stop", "length"}
    assert await _generations(db_session) == before + 1


async def test_the_openai_client_sees_the_refusal(app: Any, make_user: Any) -> None:
    _, key = await make_user("user")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=key, base_url="http://testserver/v1", http_client=http) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                response_format={"type": "json_object"},
            )
        assert caught.value.code == "unsupported_parameter"
        assert caught.value.param == "response_format"
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"max_token": 2}
            )
        assert caught.value.param == "max_token"
        assert "Unknown parameter" in caught.value.message
