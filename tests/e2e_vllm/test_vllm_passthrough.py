"""The OpenAI fields a vLLM worker honours pass through the gateway, and what they make is watermarked.

A tool call's arguments and a JSON-schema answer are text the model generated under the caller's
watermark: traced, they name the caller. Log-probabilities come back in OpenAI's shape (the gateway
under test allows them, ``XMARK_ALLOW_LOGPROBS=true``, with the default cap of 5). Processes come
from conftest.py (a CPU ``vllm serve`` worker and an ``xmark serve`` gateway with the vLLM backend).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

from tests.e2e_vllm.test_vllm_e2e import (
    ALPHA,
    MODEL,
    create_user,
    gateway_base,
    generation_rows,
    trace,
)

pytestmark = [pytest.mark.vllm, pytest.mark.model]

STORY_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 600}},
    "required": ["story"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "publish_story",
        "description": "Publish a long story.",
        "parameters": STORY_SCHEMA,
    },
}
PROMPT = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper and a storm."}]


@pytest.fixture(scope="module")
async def people(gateway: Any, e2e_config: Any) -> dict[str, dict[str, Any]]:
    # 5x margin and more: creating a user takes well under a second (0.3 s at most in tests/e2e here)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=60.0) as client:
        return {
            "carol": await create_user(client, e2e_config.admin_key, "carol"),
            "auditor": await create_user(client, e2e_config.admin_key, "auditor-2", "auditor"),
        }


async def _chat(client: httpx.AsyncClient, key: str, **fields: Any) -> dict[str, Any]:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": PROMPT, "temperature": 1.0, **fields},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_a_tool_call_is_watermarked_and_traced_to_the_caller(
    gateway: Any, e2e_config: Any, people: dict[str, dict[str, Any]]
) -> None:
    carol, auditor = people["carol"], people["auditor"]
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=600.0) as client:
        calls: list[str] = []
        completion_tokens = 0
        # the model may close the JSON early: calls are gathered until there is enough text to
        # trace with confidence (about 150 tokens name the user 97-99 % of the time; 400 leave no doubt)
        for _ in range(4):
            body = await _chat(
                client,
                carol["api_key"],
                max_tokens=320,
                n=4,
                tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "publish_story"}},
            )
            for choice in body["choices"]:
                message = choice["message"]
                assert message["tool_calls"], message
                (call,) = message["tool_calls"]
                assert call["function"]["name"] == "publish_story"
                assert isinstance(call["function"]["arguments"], str)
                calls.append((message["content"] or "") + call["function"]["arguments"])
            completion_tokens += body["usage"]["completion_tokens"]
            if completion_tokens >= 400:
                break
        assert completion_tokens >= 400, calls
        report = await trace(client, auditor["api_key"], "\n\n".join(calls))
        verdict = {field: report[field] for field in ("decoder", "test", "p_value", "scored_tokens", "candidates")}
        assert report["attribution"] is not None, verdict  # a draw: conftest.py, statistical outcomes
        assert report["attribution"]["user_id"] == carol["id"]
        assert report["attribution"]["p_value"] < ALPHA
    rows = await generation_rows(e2e_config.database_url, [carol["id"]])
    # the record holds what was generated, tool-call arguments included
    assert set(calls) <= {row["completion_text"] for row in rows}


async def test_a_json_schema_answer_is_valid_and_traced_to_the_caller(
    gateway: Any, people: dict[str, dict[str, Any]]
) -> None:
    carol, auditor = people["carol"], people["auditor"]
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=600.0) as client:
        body = await _chat(
            client,
            carol["api_key"],
            max_tokens=320,
            n=2,  # two answers: enough text to name the caller even when the model closes the JSON early
            response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}},
        )
        answers = []
        for choice in body["choices"]:
            content = choice["message"]["content"]
            if choice["finish_reason"] == "stop":
                assert isinstance(json.loads(content)["story"], str)
            else:  # cut at max_tokens: still the schema's opening
                assert re.match(r'\s*\{\s*"story"\s*:', content), content
            answers.append(content)
        report = await trace(client, auditor["api_key"], "\n\n".join(answers))
        # a draw (unseeded answers): conftest.py, statistical outcomes
        assert report["attribution"] is not None, report["candidates"]
        assert report["attribution"]["user_id"] == carol["id"]


async def test_logprobs_and_sampling_fields_pass_through(gateway: Any, people: dict[str, dict[str, Any]]) -> None:
    carol = people["carol"]
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=600.0) as client:
        body = await _chat(
            client,
            carol["api_key"],
            max_tokens=12,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            top_k=20,
            min_p=0.05,
            seed=7,
        )
        entries = body["choices"][0]["logprobs"]["content"]
        assert len(entries) == body["usage"]["completion_tokens"]
        for entry in entries:
            assert entry["logprob"] <= 0.0
            assert len(entry["top_logprobs"]) == 3
        # a token that ends inside a UTF-8 character has no text of its own: the answer shows U+FFFD where the
        # token strings show nothing (or U+FFFD), so the two agree once that mark is left out of both
        joined = "".join(e["token"] for e in entries)
        content = body["choices"][0]["message"]["content"]
        assert joined.replace("\ufffd", "") == content.replace("\ufffd", "")

        # streamed: the same entries arrive with the deltas
        streamed: list[dict[str, Any]] = []
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": PROMPT, "max_tokens": 8, "stream": True, "logprobs": True},
            headers={"Authorization": f"Bearer {carol['api_key']}"},
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:") and not line.endswith("[DONE]"):
                    for choice in json.loads(line[5:])["choices"]:
                        streamed.extend((choice.get("logprobs") or {}).get("content") or ())
        assert len(streamed) == 8

        too_many = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": PROMPT, "max_tokens": 4, "logprobs": True, "top_logprobs": 6},
            headers={"Authorization": f"Bearer {carol['api_key']}"},
        )
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"


async def test_text_completions_reach_the_workers_completions_route(
    gateway: Any, e2e_config: Any, people: dict[str, dict[str, Any]]
) -> None:
    carol, auditor = people["carol"], people["auditor"]
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
    async with httpx.AsyncClient(base_url=gateway_base(gateway), timeout=600.0) as client:
        response = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Write a long, detailed story about a lighthouse keeper.\n\nOnce upon a time",
                "max_tokens": 200,
                "temperature": 1.0,
                "n": 4,
            },
            headers={"Authorization": f"Bearer {carol['api_key']}"},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        texts = [choice["text"] for choice in body["choices"]]
        assert body["usage"]["completion_tokens"] >= 150, texts
        report = await trace(client, auditor["api_key"], "\n\n".join(texts))
        # a draw (unseeded answers): conftest.py, statistical outcomes
        assert report["attribution"] is not None and report["attribution"]["user_id"] == carol["id"]
    rows = await generation_rows(e2e_config.database_url, [carol["id"]])
    assert set(texts) <= {row["completion_text"] for row in rows}
