"""Two CPU vLLM workers with different models (and tokenizers) behind one gateway, a tool-using
conversation round trip and the Responses API, all through the official ``openai`` client.

Processes come from conftest.py: a worker serving SmolLM2, a worker serving the test model (a
tokenizer of its own), and a gateway whose models file lists both.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

from openai import AsyncOpenAI

from service.random_model import TEST_MODEL_NAME
from tests.e2e_vllm.test_vllm_e2e import MODEL, create_user, gateway_base, generation_rows, trace

pytestmark = [pytest.mark.vllm, pytest.mark.model]

PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "record_observation",
        "description": "Record the lighthouse keeper's weather observation in the log book.",
        "parameters": {
            "type": "object",
            "properties": {"observation": {"type": "string", "minLength": 800}},
            "required": ["observation"],
        },
    },
}


# the tool's answer asks for the story: a 135M model otherwise often ends with a line of thanks
TOOL_RESULT = {"status": "recorded", "next": "Now write the long, detailed story of at least 400 words."}


@pytest.fixture(scope="module")
async def fleet_people(fleet_gateway: Any, e2e_config: Any) -> dict[str, dict[str, Any]]:
    # 5x margin and more: creating a user takes well under a second (0.3 s at most in tests/e2e here)
    async with httpx.AsyncClient(base_url=gateway_base(fleet_gateway), timeout=60.0) as client:
        return {
            name: await create_user(client, e2e_config.admin_key, f"fleet-{name}", role)
            for name, role in (("ann", "user"), ("ben", "user"), ("dora", "user"), ("auditor", "auditor"))
        }


def _client(gateway: Any, key: str) -> AsyncOpenAI:
    # 5x margin and more: one answer of up to 300 tokens takes well under a minute on a CPU worker
    return AsyncOpenAI(base_url=gateway_base(gateway) + "/v1", api_key=key, timeout=600.0, max_retries=0)


async def _long_answer(client: AsyncOpenAI, model: str) -> str:
    """About 300 tokens of one model's answer (asked again while an answer ends early)."""
    texts: list[str] = []
    tokens = 0
    for _ in range(4):
        completion = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=300, temperature=1.0
        )
        texts.append(completion.choices[0].message.content or "")
        assert completion.usage is not None
        tokens += completion.usage.completion_tokens
        if tokens >= 240:
            break
    return "\n\n".join(texts)


async def test_each_model_answers_and_each_answer_names_its_caller_and_its_model(
    fleet_gateway: Any, fleet_people: dict[str, dict[str, Any]]
) -> None:
    ann, ben, auditor = fleet_people["ann"], fleet_people["ben"], fleet_people["auditor"]
    models = await _client(fleet_gateway, ann["api_key"]).models.list()
    assert [model.id for model in models.data] == [MODEL, TEST_MODEL_NAME]
    texts = {
        (ann["id"], MODEL): await _long_answer(_client(fleet_gateway, ann["api_key"]), MODEL),
        (ben["id"], TEST_MODEL_NAME): await _long_answer(_client(fleet_gateway, ben["api_key"]), TEST_MODEL_NAME),
    }
    # 5x margin and more: a trace of a few hundred tokens took 28 s at most here (test_vllm_e2e: the
    # likelihood decoder's first scoring on the worker), an answer well under a minute
    async with httpx.AsyncClient(base_url=gateway_base(fleet_gateway), timeout=600.0) as http:
        for (user_id, model), text in texts.items():
            report = await trace(http, auditor["api_key"], text)
            # a draw (unseeded answers): conftest.py, statistical outcomes
            assert report["attribution"] is not None, (model, report["p_value"], report["decoder"])
            assert report["attribution"]["user_id"] == user_id
            assert report["model"] == model
        unknown = await http.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {ann['api_key']}"},
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"


async def _round_trip(client: AsyncOpenAI) -> tuple[str, int, str, int]:
    """One tool-using conversation: the call (its arguments and tokens), the tool's result sent
    back, the final answer (its text and tokens)."""
    messages: list[Any] = [
        {"role": "system", "content": "Once the weather is recorded, write the long story the user asked for."},
        {"role": "user", "content": PROMPT + " Record the weather first."},
    ]
    call = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "record_observation"}},
        max_tokens=300,
        temperature=1.0,
    )
    message = call.choices[0].message
    assert message.tool_calls, message
    tool_call = message.tool_calls[0]
    arguments = tool_call.function.arguments  # type: ignore[union-attr]
    function = {"name": "record_observation", "arguments": arguments}
    called = {"id": tool_call.id, "type": "function", "function": function}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [called]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps(TOOL_RESULT)},
    ]
    final = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=300, temperature=1.0)
    assert call.usage is not None and final.usage is not None
    # the tool turns reached the prompt: it is longer than the call's by at least their text
    assert final.usage.prompt_tokens > call.usage.prompt_tokens
    answer = final.choices[0].message.content or ""
    return arguments, call.usage.completion_tokens, answer, final.usage.completion_tokens


async def test_a_tool_round_trip_is_watermarked_and_traced_to_the_caller(
    fleet_gateway: Any, e2e_config: Any, fleet_people: dict[str, dict[str, Any]]
) -> None:
    dora, auditor = fleet_people["dora"], fleet_people["auditor"]
    client = _client(fleet_gateway, dora["api_key"])
    calls: list[str] = []
    answers: list[str] = []
    call_tokens = answer_tokens = 0
    named: dict[str, Any] = {}
    # a model may close the JSON, or answer, early, and a tool call's JSON repeats itself (the trace
    # scores each (x[t-2], x[t-1], x[t]) once): round trips are gathered until each side, traced on its
    # own, names someone (at most 8 round trips); every name it gives on the way must be the caller's
    # 5x margin and more: a trace of a few hundred tokens took 28 s at most here (test_vllm_e2e: the
    # likelihood decoder's first scoring on the worker), an answer well under a minute
    async with httpx.AsyncClient(base_url=gateway_base(fleet_gateway), timeout=600.0) as http:
        for _ in range(8):
            arguments, used, answer, answered = await _round_trip(client)
            calls.append(arguments)
            answers.append(answer)
            call_tokens += used
            answer_tokens += answered
            if min(call_tokens, answer_tokens) < 150:  # too little text yet to name anyone with confidence
                continue
            for side, texts in (("calls", calls), ("answers", answers)):
                if side not in named:
                    report = await trace(http, auditor["api_key"], "\n\n".join(texts))
                    if report["attribution"] is not None:
                        assert report["attribution"]["user_id"] == dora["id"], (side, report["attribution"])
                        named[side] = report
            if len(named) == 2:
                break
    # the calls and the answers each name the caller on their own
    assert set(named) == {"calls", "answers"}, (call_tokens, answer_tokens, sorted(named))
    rows = await generation_rows(e2e_config.database_url, [dora["id"]])
    recorded = [row["completion_text"] for row in rows]
    assert set(answers) <= set(recorded)  # the final answers are recorded as generated
    assert all(any(arguments in text for text in recorded if text) for arguments in calls)  # the calls too


async def test_the_responses_api_on_vllm_streamed_and_not(
    fleet_gateway: Any, fleet_people: dict[str, dict[str, Any]]
) -> None:
    ann, auditor = fleet_people["ann"], fleet_people["auditor"]
    client = _client(fleet_gateway, ann["api_key"])
    response = await client.responses.create(
        model=MODEL, instructions="You are a storyteller.", input=PROMPT, max_output_tokens=200, temperature=1.0
    )
    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0
    streamed: list[str] = []
    completed: Any = None
    stream = await client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=200, stream=True)
    async for event in stream:
        if event.type == "response.output_text.delta":
            streamed.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert completed is not None and completed.output_text == "".join(streamed)
    # 5x margin and more: a trace of a few hundred tokens took 28 s at most here (test_vllm_e2e: the
    # likelihood decoder's first scoring on the worker), an answer well under a minute
    async with httpx.AsyncClient(base_url=gateway_base(fleet_gateway), timeout=600.0) as http:
        report = await trace(http, auditor["api_key"], response.output_text + "\n\n" + "".join(streamed))
    assert report["attribution"] is not None, report["p_value"]  # a draw: conftest.py, statistical outcomes
    assert report["attribution"]["user_id"] == ann["id"]
    assert report["model"] == MODEL
