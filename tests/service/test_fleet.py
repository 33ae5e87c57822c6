"""Two models with different tokenizers behind one gateway (``XMARK_MODELS_FILE``): listing,
routing by name and alias, records that carry the model, and /trace naming the caller and the
model that wrote the text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation
from service.random_model import TEST_MODEL_NAME
from tests.conftest import REPO_ROOT, checkpoint_path, make_test_settings

# the verdicts depend on the users' message IDs (what is written, what it is told apart from):
# drawn from a seeded generator (tests/service/conftest.py), with the answers seeded (``_chat``),
# they give one outcome on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]

DEFAULT = "smollm2-135m-instruct"
PROMPT = "Write a long story about a lighthouse keeper and the ships she watched."
HUMAN_TEXT = (
    "The harbour froze early that winter, and the ferry stopped running before the first week of "
    "December. People walked across the ice to the island with sledges full of flour and lamp oil, "
    "and the children skated in long lines between the moored fishing boats until dark. My grandmother "
    "kept a diary of those months; most of it is about the weather, the price of coal and who was ill."
)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory, migrated_database: str) -> AsyncIterator[Any]:
    """A gateway serving the packaged model and the test model, from a models file."""
    from service.app import create_app

    folder = tmp_path_factory.mktemp("fleet")
    models = folder / "models.toml"
    models.write_text(
        f"""
[[models]]
name = "{DEFAULT}"
aliases = ["smollm2"]
path = "{checkpoint_path()}"

[[models]]
name = "{TEST_MODEL_NAME}"
path = "{REPO_ROOT / "var" / "models" / TEST_MODEL_NAME}"
max_completion_tokens = 300
"""
    )
    settings = make_test_settings(folder / "var", model_path=None, models_file=models)
    application = create_app(settings)
    async with application.router.lifespan_context(application):
        for model in application.state.resources.fleet:
            assert await model.backend.wait_ready(180), f"{model.name} did not load"
        yield application


async def _chat(client: httpx.AsyncClient, key: str, model: str, *, tokens: int = 200) -> dict[str, Any]:
    """An answer of at least 3/4 of ``tokens`` (a temperature-1 answer may end early: asked again)."""
    for seed in range(11, 16):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "temperature": 1.0,
            "seed": seed,
        }
        response = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
        assert response.status_code == 200, response.text
        if response.json()["usage"]["completion_tokens"] >= 0.75 * tokens:
            break
    return response.json()  # type: ignore[no-any-return]


async def test_models_lists_every_served_model(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    response = await client.get("/v1/models", headers=_auth(key))
    assert response.status_code == 200
    assert [card["id"] for card in response.json()["data"]] == [DEFAULT, TEST_MODEL_NAME]


async def test_a_model_is_retrieved_by_its_name_or_alias(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    for name, served in ((DEFAULT, DEFAULT), ("smollm2", DEFAULT), (TEST_MODEL_NAME, TEST_MODEL_NAME)):
        response = await client.get(f"/v1/models/{name}", headers=_auth(key))
        assert response.status_code == 200, response.text
        assert response.json()["id"] == served and response.json()["object"] == "model"
    missing = await client.get("/v1/models/smollm3", headers=_auth(key))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_messages_are_routed_by_name_and_alias(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession
) -> None:
    """Anthropic's Messages API reaches every model of the fleet, each under its own limits."""
    _, key = await make_user("user")
    headers = {"x-api-key": key}
    for name, served in (("smollm2", DEFAULT), (TEST_MODEL_NAME, TEST_MODEL_NAME)):
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        response = await client.post("/v1/messages", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == served
        prompt = {"model": name, "messages": body["messages"]}
        counted = await client.post("/v1/messages/count_tokens", json=prompt, headers=headers)
        assert counted.status_code == 200 and counted.json()["input_tokens"] == response.json()["usage"]["input_tokens"]
        for _ in range(100):
            row = await db_session.scalar(select(Generation).where(Generation.request_id == response.json()["id"]))
            if row is not None:
                break
            await asyncio.sleep(0.05)  # written as the response ends
        assert row is not None and row.model == served
    too_many = {"model": TEST_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 301}
    response = await client.post("/v1/messages", json=too_many, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "at most 300" in response.json()["error"]["message"]


async def test_an_unknown_model_is_404_in_the_envelope(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "not_found_error")
    traced = await client.post("/trace", json={"text": HUMAN_TEXT, "model": "gpt-4o"}, headers=_auth(key))
    assert traced.status_code in (403, 404)  # a user may not trace at all


async def test_a_model_keeps_its_own_limits(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    body = {"model": TEST_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 301}
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
    assert response.status_code == 400
    assert "at most 300" in response.json()["error"]["message"]
    body["model"] = DEFAULT  # the gateway's own limit (1024) applies to the other one
    body["max_tokens"] = 2
    assert (await client.post("/v1/chat/completions", json=body, headers=_auth(key))).status_code == 200


async def test_each_answer_is_traced_to_its_caller_and_its_model(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession
) -> None:
    first, first_key = await make_user("user")
    second, second_key = await make_user("user")
    _, auditor_key = await make_user("auditor")
    by_alias = await _chat(client, first_key, "smollm2")
    assert by_alias["model"] == DEFAULT  # an alias answers with the model's name
    other = await _chat(client, second_key, TEST_MODEL_NAME)
    assert other["model"] == TEST_MODEL_NAME
    for completion, caller, model in ((by_alias, first, DEFAULT), (other, second, TEST_MODEL_NAME)):
        text = completion["choices"][0]["message"]["content"]
        rows = (await db_session.scalars(select(Generation).where(Generation.request_id == completion["id"]))).all()
        assert [row.model for row in rows] == [model]
        traced = await client.post("/trace", json={"text": text}, headers=_auth(auditor_key))
        assert traced.status_code == 200, traced.text
        report = traced.json()
        verdict = {k: report[k] for k in ("p_value", "decoder", "scored_tokens", "watermarked", "model")}
        assert report["attribution"] is not None, (model, verdict, completion["usage"])
        assert report["attribution"]["user_id"] == caller["user_id"]
        assert report["model"] == model
        # read by the model that did not write it, the text names nobody
        wrong = TEST_MODEL_NAME if model == DEFAULT else DEFAULT
        misread = await client.post("/trace", json={"text": text, "model": wrong}, headers=_auth(auditor_key))
        assert misread.status_code == 200
        assert misread.json()["attribution"] is None
        assert misread.json()["model"] is None or not misread.json()["watermarked"]


async def test_a_text_nobody_generated_names_no_one_and_no_model(client: httpx.AsyncClient, make_user: Any) -> None:
    _, auditor_key = await make_user("auditor")
    response = await client.post("/trace", json={"text": HUMAN_TEXT}, headers=_auth(auditor_key))
    assert response.status_code == 200
    report = response.json()
    assert report["attribution"] is None
    assert report["watermarked"] is False
    assert report["model"] is None


async def test_the_fan_out_counts_every_model(client: httpx.AsyncClient, make_user: Any) -> None:
    """The same text traced against one model and against both: the two-model trace pays for
    the second model's tests (its p-value is larger by the ratio of the counts)."""
    user, key = await make_user("user")
    _, auditor_key = await make_user("auditor")
    # 280 tokens: at 120 the decoded message of some user IDs showed only p = 0.28 (seen once in CI,
    # before the IDs were seeded)
    text = (await _chat(client, key, TEST_MODEL_NAME, tokens=280))["choices"][0]["message"]["content"]
    both = (await client.post("/trace", json={"text": text, "decoder": "counting"}, headers=_auth(auditor_key))).json()
    alone = (
        await client.post(
            "/trace", json={"text": text, "decoder": "counting", "model": TEST_MODEL_NAME}, headers=_auth(auditor_key)
        )
    ).json()
    assert 0 < alone["p_value"] < 0.1, alone  # a watermark shows (a p-value of 1 would prove nothing)
    # one counting test per tokenization: two tokenizers double the count
    assert both["p_value"] == pytest.approx(2 * alone["p_value"], rel=1e-6)
    assert user["user_id"] in {c["user_id"] for c in alone["candidates"]}


def test_the_example_models_file_is_valid(tmp_path: Path) -> None:
    from service.fleet import load_models_file

    entries = load_models_file(REPO_ROOT / "deploy" / "models.example.toml")
    assert [entry.name for entry in entries] == [DEFAULT, TEST_MODEL_NAME]
