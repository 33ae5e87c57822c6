"""The OpenAI Agents SDK (``openai-agents``, pinned in tests/clients/requirements.txt, run by
.venv-clients) at its defaults, tracing export off (no network): one agent on each of its model
classes, ``OpenAIResponsesModel`` and ``OpenAIChatCompletionsModel``, each answer traced to its caller.

The SDK treats a response cut by its token budget (``status: incomplete``, as OpenAI reports it) as
a failed run (``ModelBehaviorError``), and no budget makes the small CPU model end every answer by
itself: it ends most of this prompt's stories within a few hundred tokens, but in samples here 2 of
16 ran past 600 tokens (one to 733, one longer), and a shorter prompt ("in four or five sentences")
ran into a loop to the gateway's largest budget (1,024) in one of its first samples. So a run the SDK
refuses for exactly that reason (the response's ``incomplete_details.reason`` is
``max_output_tokens``: the gateway reported the cut as OpenAI does) is made again, up to
``ATTEMPTS`` times; any other failure fails the row at once. Every request made is reported
(``requests``) and must be in the gateway's usage. At the rate measured (2 in 16 per attempt; 95 %
upper bound 0.38) the row fails for this reason with probability about 0.125^6 = 4e-6 per run
(at the upper bound, 3e-3).
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
from agents import (Agent, ModelBehaviorError, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    RunResult, Runner, set_tracing_disabled)

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["CLIENT_BASE_URL"] + "/v1", api_key=os.environ["CLIENT_API_KEY"])

async def run(model_class):
    agent = Agent(
        name="writer",
        model=model_class(model=os.environ["CLIENT_MODEL"], openai_client=client),
        model_settings=ModelSettings(max_tokens=int(os.environ["CLIENT_MAX_TOKENS"])),
    )
    attempts = int(os.environ["CLIENT_ATTEMPTS"])
    for attempt in range(1, attempts + 1):
        try:
            result = await Runner.run(agent, os.environ["CLIENT_PROMPT"])
        except ModelBehaviorError as error:
            # only the SDK's refusal of an answer cut by its budget is tried again
            if "reason='max_output_tokens'" not in str(error) or attempt == attempts:
                raise
            continue
        assert isinstance(result, RunResult) and isinstance(result.final_output, str), type(result)
        return {"text": result.final_output, "kind": type(result).__name__,
                "output_tokens": result.context_wrapper.usage.output_tokens, "requests": attempt}

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
        CLIENT_ATTEMPTS="6",
    ),
)
