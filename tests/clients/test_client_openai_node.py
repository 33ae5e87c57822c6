"""The official ``openai`` Node client (npm, pinned in tests/clients/node/package-lock.json) at its
defaults: chat and chat streamed, each answer traced to its caller."""

from __future__ import annotations

import pytest

# the row's tests are the harness's, collected here with this module's CLIENT
from tests.clients.harness import (  # noqa: F401
    Call,
    ClientRow,
    node_client,
    test_the_answer_is_the_clients_and_traced_to_its_caller,
    test_the_gateway_recorded_every_call,
)

pytestmark = pytest.mark.model

SNIPPET = """
import OpenAI from "openai";

const env = process.env;
const client = new OpenAI({ baseURL: `${env.CLIENT_BASE_URL}/v1`, apiKey: env.CLIENT_API_KEY });
const request = {
  model: env.CLIENT_MODEL,
  messages: [{ role: "user", content: env.CLIENT_PROMPT }],
  max_tokens: Number(env.CLIENT_MAX_TOKENS),
};

async function chat() {
  const reply = await client.chat.completions.create(request);
  return { text: reply.choices[0].message.content, kind: reply.object, output_tokens: reply.usage.completion_tokens };
}

async function chatStream() {
  const stream = await client.chat.completions.create({ ...request, stream: true });
  const pieces = [];
  let kind = null;
  for await (const chunk of stream) {
    kind = chunk.object;
    for (const choice of chunk.choices) if (choice.delta.content) pieces.push(choice.delta.content);
  }
  return { text: pieces.join(""), kind, pieces: pieces.length };
}

await waitForStart();
const [plain, streamed] = await Promise.all([chat(), chatStream()]);
console.log(JSON.stringify({ chat: plain, chat_stream: streamed }));
"""

CLIENT = ClientRow(
    client="openai (Node)",
    calls=(Call("chat", "chat.completion"), Call("chat_stream", "chat.completion.chunk", streamed=True)),
    run=node_client(SNIPPET),
)
