"""Log-probabilities on the local backend: off unless the operator allows them, OpenAI's shape, the
model's own distribution (before the watermark bias), capped alternatives, streamed with the deltas."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture
async def allowed(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"
    monkeypatch.setattr(app.state.resources.settings, "allow_logprobs", True)


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": PROMPT, "max_tokens": 6, "temperature": 0, **fields}


async def test_logprobs_are_refused_unless_allowed(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    response = await client.post(
        "/v1/chat/completions", json=_body(logprobs=True), headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (
        "unsupported_parameter",
        "logprobs",
    )


async def test_logprobs_describe_the_model_before_the_watermark(
    app: Any, client: httpx.AsyncClient, make_user: Any, allowed: None
) -> None:
    _, key = await make_user("user")
    response = await client.post(
        "/v1/chat/completions",
        json=_body(logprobs=True, top_logprobs=3),
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == response.json()["usage"]["completion_tokens"] == 6
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    for entry in entries:
        assert bytes(entry["bytes"]).decode() == entry["token"]
        alternatives = [a["logprob"] for a in entry["top_logprobs"]]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert entry["logprob"] <= alternatives[0] + 1e-6
    # the first token's alternatives are the model's own next-token distribution after the prompt
    backend = app.state.resources.backend
    from service.backends.base import ChatTurn, GenerationRequest

    prompt = await backend._prompt_ids(
        GenerationRequest(messages=(ChatTurn("user", PROMPT[0]["content"]),), max_tokens=1)
    )
    # the generation model in float32 (``backend.score`` may run a bfloat16 copy for /trace)
    from service.backends.scoring import score_texts

    pad = int(backend._tokenizer.pad_token_id)
    (scores,) = await asyncio.to_thread(score_texts, backend._model, pad, [[*prompt, 0]], 3)
    expected = scores.top_logprobs[len(prompt)]
    got = np.array([a["logprob"] for a in entries[0]["top_logprobs"]])
    assert np.allclose(got, expected, atol=2e-3), (got, expected)


async def test_streamed_logprobs_and_the_cap(client: httpx.AsyncClient, make_user: Any, allowed: None) -> None:
    _, key = await make_user("user")
    headers = {"Authorization": f"Bearer {key}"}
    entries: list[dict[str, Any]] = []
    text: list[str] = []
    async with client.stream(
        "POST", "/v1/chat/completions", json=_body(stream=True, logprobs=True), headers=headers
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and not line.endswith("[DONE]"):
                for choice in json.loads(line[5:])["choices"]:
                    entries.extend((choice.get("logprobs") or {}).get("content") or ())
                    text.append(choice["delta"].get("content") or "")
    assert len(entries) == 6
    assert "".join(e["token"] for e in entries) == "".join(text)
    assert all(e["top_logprobs"] == [] for e in entries)

    too_many = await client.post("/v1/chat/completions", json=_body(logprobs=True, top_logprobs=6), headers=headers)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"
    alone = await client.post("/v1/chat/completions", json=_body(top_logprobs=2), headers=headers)
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "top_logprobs"
