"""The official ``openai`` Python client (the product's test extra pins it) at its defaults: chat,
chat streamed and the Responses API, each answer traced to its caller."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

# the row's tests are the harness's, collected here with this module's CLIENT
from tests.clients.harness import (  # noqa: F401
    MAX_TOKENS,
    MODEL,
    PROMPT,
    Answer,
    Call,
    Caller,
    ClientRow,
    in_process,
    test_the_answer_is_the_clients_and_traced_to_its_caller,
    test_the_gateway_recorded_every_call,
)

pytestmark = pytest.mark.model


async def _calls(caller: Caller) -> dict[str, Answer]:
    async with openai.AsyncOpenAI(base_url=f"{caller.base_url}/v1", api_key=caller.api_key) as client:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]

        async def chat() -> Answer:
            reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
            assert isinstance(reply, ChatCompletion) and reply.usage is not None
            text = reply.choices[0].message.content or ""
            return Answer(text, type(reply).__name__, output_tokens=reply.usage.completion_tokens)

        async def chat_stream() -> Answer:
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
            )
            pieces: list[str] = []
            async for chunk in stream:
                assert isinstance(chunk, ChatCompletionChunk)
                pieces.extend(choice.delta.content for choice in chunk.choices if choice.delta.content)
            return Answer("".join(pieces), type(chunk).__name__, pieces=len(pieces))

        async def responses() -> Answer:
            response = await client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS)
            assert isinstance(response, Response) and response.usage is not None
            return Answer(response.output_text, type(response).__name__, output_tokens=response.usage.output_tokens)

        answers = await asyncio.gather(chat(), chat_stream(), responses())
    return dict(zip(("chat", "chat_stream", "responses"), answers, strict=True))


CLIENT = ClientRow(
    client="openai (Python)",
    calls=(
        Call("chat", "ChatCompletion"),
        Call("chat_stream", "ChatCompletionChunk", streamed=True),
        Call("responses", "Response"),
    ),
    run=in_process(_calls),
)
