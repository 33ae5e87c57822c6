"""What newer OpenAI clients send and ask for: ``developer`` messages in chat (a system turn by its
newer name) and ``GET /v1/models/{model}`` (one served model's object, by its name or an alias).
On the fake backend or the real model alike: a greedy answer is a function of its turns."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from service.services.generation import OWNED_BY


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def key(app: Any, make_user: Any) -> str:
    assert await app.state.resources.backend.wait_ready(180), "the model did not load"
    return str((await make_user("user"))[1])


def _chat(role: str, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }


async def test_a_developer_message_is_a_system_message(client: httpx.AsyncClient, key: str) -> None:
    developer = await client.post("/v1/chat/completions", json=_chat("developer"), headers=_bearer(key))
    assert developer.status_code == 200, developer.text
    system = await client.post("/v1/chat/completions", json=_chat("system"), headers=_bearer(key))
    assert system.status_code == 200, system.text
    assert developer.json()["choices"][0]["message"] == system.json()["choices"][0]["message"]
    assert developer.json()["usage"] == system.json()["usage"]  # the same prompt, token for token


async def test_a_developer_message_streams_and_goes_through_the_openai_client(
    app: Any, client: httpx.AsyncClient, key: str
) -> None:
    streamed = await client.post("/v1/chat/completions", json=_chat("developer", stream=True), headers=_bearer(key))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    system = (await client.post("/v1/chat/completions", json=_chat("system"), headers=_bearer(key))).json()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=key, base_url="http://testserver/v1", http_client=http) as sdk:
        reply = await sdk.chat.completions.create(**_chat("developer"))
    assert reply.choices[0].message.content == system["choices"][0]["message"]["content"]


async def test_a_developer_message_keeps_chats_rules(client: httpx.AsyncClient, key: str) -> None:
    """Only what a system message may carry: no tool calls, no tool_call_id."""
    body = _chat("developer")
    body["messages"][0]["tool_call_id"] = "call_1"
    response = await client.post("/v1/chat/completions", json=body, headers=_bearer(key))
    assert response.status_code == 422 and response.json()["error"]["param"] == "messages.0"


async def test_a_model_is_retrieved_by_name(app: Any, client: httpx.AsyncClient, key: str) -> None:
    name = app.state.resources.fleet.default.name
    response = await client.get(f"/v1/models/{name}", headers=_bearer(key))
    assert response.status_code == 200, response.text
    assert response.json() == {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY}
    listed = (await client.get("/v1/models", headers=_bearer(key))).json()["data"]
    assert response.json() in listed
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=key, base_url="http://testserver/v1", http_client=http) as sdk:
        model = await sdk.models.retrieve(name)
        assert model.id == name and model.object == "model"
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


@pytest.mark.parametrize("name", ["gpt-4o", "org/some-model", "smollm2-135m-instruct-x"])
async def test_an_unknown_model_is_404_in_the_openai_envelope(client: httpx.AsyncClient, key: str, name: str) -> None:
    response = await client.get(f"/v1/models/{name}", headers=_bearer(key))
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": f"The model '{name}' does not exist",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


async def test_retrieving_a_model_needs_a_key(app: Any, client: httpx.AsyncClient) -> None:
    name = app.state.resources.fleet.default.name
    for headers in ({}, _bearer("xm_not-a-key"), {"x-api-key": "xm_not-a-key"}):
        response = await client.get(f"/v1/models/{name}", headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_listed_name_of_every_served_name_and_alias() -> None:
    """GET /v1/models/{model} answers for a chat or an embedding model by its name or any alias,
    under the name /v1/models lists; any other name is 404 ``model_not_found``."""
    from types import SimpleNamespace

    from service.errors import NotFoundError
    from service.fleet import Fleet, ServedModel

    chat = ServedModel("chat-model", SimpleNamespace(), aliases=("chat-alias",))  # type: ignore[arg-type]
    fleet = Fleet([chat], embedding=[("embed-model", ("embed-alias",))])
    assert fleet.names() == ["chat-model", "embed-model"]
    for name, listed in [
        ("chat-model", "chat-model"),
        ("chat-alias", "chat-model"),
        ("embed-model", "embed-model"),
        ("embed-alias", "embed-model"),
    ]:
        assert fleet.listed_name(name) == listed
    with pytest.raises(NotFoundError) as caught:
        fleet.listed_name("nothing")
    assert caught.value.code == "model_not_found"
