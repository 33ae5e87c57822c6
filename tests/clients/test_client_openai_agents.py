"""The OpenAI Agents SDK (``openai-agents``, pinned in tests/clients/requirements.txt, run by
.venv-clients) at its defaults, tracing export off (no network): one agent on each of its model
classes, ``OpenAIResponsesModel`` and ``OpenAIChatCompletionsModel``, each answer traced to its caller.

The SDK treats a response cut by its token budget (``status: incomplete``, as OpenAI reports it) as
a failed run, so this row asks for a story the model ends by itself (120 to 370 tokens in samples of
this prompt), within a budget it does not reach.
"""

from __future__ import annotations

import pytest

# the row's tests are the harness's, collected here with this module's CLIENT
from tests.clients.harness import (  # noqa: F401
    Call,
    ClientRow,
    python_client,
    test_the_answer_is_the_clients_and_traced_to_its_caller,
    test_the_gateway_recorded_every_call,
)

pytestmark = pytest.mark.model

SNIPPET = """
import asyncio, json, os
from openai import AsyncOpenAI
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunResult,
                    Runner, set_tracing_disabled)

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["CLIENT_BASE_URL"] + "/v1", api_key=os.environ["CLIENT_API_KEY"])

async def run(model_class):
    agent = Agent(
        name="writer",
        model=model_class(model=os.environ["CLIENT_MODEL"], openai_client=client),
        model_settings=ModelSettings(max_tokens=int(os.environ["CLIENT_MAX_TOKENS"])),
    )
    result = await Runner.run(agent, os.environ["CLIENT_PROMPT"])
    assert isinstance(result, RunResult) and isinstance(result.final_output, str), type(result)
    return {"text": result.final_output, "kind": type(result).__name__,
            "output_tokens": result.context_wrapper.usage.output_tokens}

async def main():
    responses, chat = await asyncio.gather(run(OpenAIResponsesModel), run(OpenAIChatCompletionsModel))
    print(json.dumps({"responses_model": responses, "chat_completions_model": chat}))

wait_for_start()
asyncio.run(main())
"""

CLIENT = ClientRow(
    client="OpenAI Agents SDK (openai-agents)",
    calls=(Call("responses_model", "RunResult"), Call("chat_completions_model", "RunResult")),
    run=python_client(
        SNIPPET,
        OPENAI_AGENTS_DISABLE_TRACING="1",
        CLIENT_PROMPT="Write a story of about 150 words about a lighthouse keeper.",
        CLIENT_MAX_TOKENS="600",
    ),
)
