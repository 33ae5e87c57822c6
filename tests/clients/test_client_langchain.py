"""LangChain's ``ChatOpenAI`` (``langchain-openai``, pinned in tests/clients/requirements.txt, run by
.venv-clients) at its defaults: ``invoke`` and ``stream``, each answer traced to its caller.
(``bind_tools`` needs the vLLM backend: tests/e2e_vllm/test_vllm_clients.py.)"""

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
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI

llm = ChatOpenAI(
    model=os.environ["CLIENT_MODEL"],
    base_url=os.environ["CLIENT_BASE_URL"] + "/v1",
    api_key=os.environ["CLIENT_API_KEY"],
    max_tokens=int(os.environ["CLIENT_MAX_TOKENS"]),
)
prompt = os.environ["CLIENT_PROMPT"]

async def invoke():
    message = await llm.ainvoke(prompt)
    assert isinstance(message, AIMessage), type(message)
    return {"text": message.content, "kind": type(message).__name__,
            "output_tokens": (message.usage_metadata or {}).get("output_tokens")}

async def stream():
    pieces, whole = [], None
    async for chunk in llm.astream(prompt):
        assert isinstance(chunk, AIMessageChunk), type(chunk)
        if chunk.content:
            pieces.append(chunk.content)
        whole = chunk if whole is None else whole + chunk
    assert whole.content == "".join(pieces)
    return {"text": whole.content, "kind": type(whole).__name__, "pieces": len(pieces)}

async def main():
    invoked, streamed = await asyncio.gather(invoke(), stream())
    print(json.dumps({"invoke": invoked, "stream": streamed}))

wait_for_start()
asyncio.run(main())
"""

CLIENT = ClientRow(
    client="LangChain ChatOpenAI (langchain-openai)",
    calls=(Call("invoke", "AIMessage"), Call("stream", "AIMessageChunk", streamed=True)),
    run=python_client(SNIPPET, LANGSMITH_TRACING="false"),
)
