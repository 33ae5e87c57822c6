"""Anthropic's Messages API on the vLLM backend, which honours tools and ``top_k``: ``tools`` and
``tool_choice`` reach the worker in OpenAI's shape, its tool call comes back as a ``tool_use`` block
(streamed: ``input_json_delta`` pieces), and a ``tool_result`` continues the conversation. Processes
come from conftest.py (a CPU ``vllm serve`` worker and an ``xmark serve`` gateway)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

from tests.e2e_vllm.test_vllm_e2e import MODEL, create_user, gateway_base, generation_rows

pytestmark = [pytest.mark.vllm, pytest.mark.model]

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
async def dave(gateway: Any, e2e_config: Any) -> dict[str, Any]:
    # 5x margin and more: creating a user takes well under a second (0.3 s at most in tests/e2e here)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=60.0) as client:
        return await create_user(client, e2e_config.admin_key, "dave")


def _headers(user: dict[str, Any]) -> dict[str, str]:
    return {"x-api-key": user["api_key"], "anthropic-version": "2023-06-01"}


async def test_a_tool_call_is_a_tool_use_block(gateway: Any, e2e_config: Any, dave: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 120,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "top_k": 20,
    }
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=600.0) as client:
        response = await client.post("/v1/messages", json=body, headers=_headers(dave))
        assert response.status_code == 200, response.text
        message = response.json()
        # a call the budget cut short is still a call (its stop reason then says max_tokens)
        assert message["stop_reason"] == "tool_use" or message["usage"]["output_tokens"] == 120, message
        [call] = [block for block in message["content"] if block["type"] == "tool_use"]
        # the input is the JSON the model wrote (the test model does not always write the object)
        assert call["name"] == "get_weather" and call["id"] and call["input"] is not None

        # streamed: the call's block and its input in pieces
        streamed: list[dict[str, Any]] = []
        async with client.stream(
            "POST", "/v1/messages", json={**body, "stream": True}, headers=_headers(dave)
        ) as events:
            assert events.status_code == 200
            async for line in events.aiter_lines():
                if line.startswith("data:"):
                    streamed.append(json.loads(line[5:]))
        starts = [e["content_block"] for e in streamed if e["type"] == "content_block_start"]
        assert any(block["type"] == "tool_use" and block["name"] == "get_weather" for block in starts)
        pieces = [
            e["delta"]["partial_json"]
            for e in streamed
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
        ]
        assert "".join(pieces).strip()
        final = next(e for e in streamed if e["type"] == "message_delta")
        assert final["delta"]["stop_reason"] == "tool_use" or final["usage"]["output_tokens"] == 120

        # the caller answers the call: the conversation continues to a text answer
        follow_up = {
            "model": MODEL,
            "max_tokens": 40,
            "tools": [WEATHER],
            "messages": [
                *QUESTION,
                {"role": "assistant", "content": [{**call, "input": {"city": "Paris"}}]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "Sunny, 24 C"}],
                },
            ],
        }
        answered = await client.post("/v1/messages", json=follow_up, headers=_headers(dave))
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["input_tokens"] > message["usage"]["input_tokens"]
    # a record is written as its response ends: a poll of at least 10 s, 5x margin and more (the
    # row was there 0.03 s after the response in tests/e2e here)
    for _ in range(100):
        rows = {row["request_id"]: row for row in await generation_rows(e2e_config.database_url, [dave["id"]])}
        if answered.json()["id"] in rows:
            break
        await asyncio.sleep(0.1)
    assert {message["id"], answered.json()["id"]} <= rows.keys()
    # the record holds what was generated: the call's arguments, which are the block's input
    text = "".join(block["text"] for block in message["content"] if block["type"] == "text")
    arguments = rows[message["id"]]["completion_text"].removeprefix(text)
    assert json.loads(arguments) == call["input"] if message["stop_reason"] == "tool_use" else arguments
