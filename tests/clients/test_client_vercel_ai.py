"""The Vercel AI SDK (npm ``ai`` with ``@ai-sdk/openai``, pinned in tests/clients/node/package-lock.json)
at its defaults, whose OpenAI provider calls the Responses API: ``generateText`` and ``streamText``,
each answer traced to its caller."""

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
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText } from "ai";

const env = process.env;
const openai = createOpenAI({ baseURL: `${env.CLIENT_BASE_URL}/v1`, apiKey: env.CLIENT_API_KEY });
const request = {
  model: openai(env.CLIENT_MODEL),
  prompt: env.CLIENT_PROMPT,
  maxOutputTokens: Number(env.CLIENT_MAX_TOKENS),
};

async function generate() {
  const result = await generateText(request);
  return { text: result.text, kind: result.constructor.name, output_tokens: result.usage.outputTokens };
}

async function stream() {
  let failure = null;
  const result = streamText({ ...request, onError: ({ error }) => { failure = error; } });
  const pieces = [];
  for await (const piece of result.textStream) if (piece) pieces.push(piece);
  if (failure) throw failure;
  const text = await result.text;
  if (text !== pieces.join("")) throw new Error("the streamed pieces are not the text");
  const usage = await result.usage;
  return { text, kind: result.constructor.name, pieces: pieces.length, output_tokens: usage.outputTokens };
}

await waitForStart();
const [generated, streamed] = await Promise.all([generate(), stream()]);
console.log(JSON.stringify({ generate_text: generated, stream_text: streamed }));
"""

CLIENT = ClientRow(
    client="Vercel AI SDK (ai, @ai-sdk/openai)",
    calls=(
        Call("generate_text", "DefaultGenerateTextResult"),
        Call("stream_text", "DefaultStreamTextResult", streamed=True),
    ),
    run=node_client(SNIPPET),
)
