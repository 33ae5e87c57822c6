"""The official ``anthropic`` Python SDK (the product's test extra pins it) at its defaults on
Anthropic's Messages API: ``messages.create`` and ``messages.stream``, each answer traced to its
caller. (Its tool round trip needs the vLLM backend: tests/e2e_vllm/test_vllm_clients.py.)"""

from __future__ import annotations

import asyncio

import anthropic
import pytest
from anthropic.types import Message, ParsedMessage

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
    async with anthropic.AsyncAnthropic(base_url=caller.base_url, api_key=caller.api_key) as client:

        async def create() -> Answer:
            message = await client.messages.create(
                model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]
            )
            assert isinstance(message, Message)
            text = "".join(block.text for block in message.content if block.type == "text")
            return Answer(text, type(message).__name__, output_tokens=message.usage.output_tokens)

        async def stream() -> Answer:
            pieces: list[str] = []
            async with client.messages.stream(
                model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]
            ) as events:
                async for piece in events.text_stream:
                    pieces.append(piece)
                message = await events.get_final_message()
            assert isinstance(message, ParsedMessage)
            text = "".join(block.text for block in message.content if block.type == "text")
            assert text == "".join(pieces)
            return Answer(text, type(message).__name__, pieces=len(pieces), output_tokens=message.usage.output_tokens)

        answers = await asyncio.gather(create(), stream())
    return dict(zip(("create", "stream"), answers, strict=True))


CLIENT = ClientRow(
    client="anthropic (Python)",
    calls=(Call("create", "Message"), Call("stream", "ParsedMessage", streamed=True)),
    run=in_process(_calls),
)
