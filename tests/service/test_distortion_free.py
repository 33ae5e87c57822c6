"""The gateway serving a distortion-free key version (``XMARK_WATERMARK_SCHEME=gumbel``): the local
backend samples every token with the key (blocks of 8 bits, 16 salts), ``/trace`` names the author of
the answer, one user's answers to one prompt differ (consecutive salts), requests it could not honour
are refused by name (on vLLM workers also the fields they apply after the choice, and n > 1) while a
nucleus (top_p, and top_k / min_p on vLLM) is sampled within, and a
backend that cannot sample with the key is refused at start-up and per request."""

from __future__ import annotations

import random
import types
from dataclasses import replace
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.backends import build_backend
from service.config import ConfigurationError
from service.errors import InvalidRequestError, ServiceUnavailableError
from service.fleet import ServedModel
from service.keyring import Keyring, params_from_settings
from service.metrics import Metrics
from service.models import KeyVersion
from service.repositories.unit import Repositories
from service.resources import _check_scheme_served
from service.schemas.admin import CreatedUser
from service.services.encoder_choice import check_keyed_sampling
from service.services.users import UserService
from tests.conftest import TEST_WATERMARK_SECRETS, make_test_settings
from tests.fakes import FakeBackend
from tests.service.conftest import make_only_active_version
from xmark_core import WatermarkParams
from xmark_core.encoders import KeyVersionSpec

GUMBEL = WatermarkParams(bits=32, block_bits=8, num_keys=1, scheme="gumbel", salts=16)
MODEL = "smollm2-135m-instruct"
S2 = TEST_WATERMARK_SECRETS["v2"].encode()
# the seed of the first salts of ``seeded_salts``
SALT_SEED = 20261203


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def seeded_salts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's first salt (``service.salts.SaltRotation``: a random one, then consecutive ones)
    drawn from a generator seeded here instead of the system's randomness: an unseeded request's
    answer under the keyed sampler is a fixed function of the user's message ID, the prompt and the
    salt, so with the IDs seeded too (``seeded_message_ids``) the answers, and their verdicts, are
    the same on every run."""
    import service.salts

    monkeypatch.setattr(service.salts, "secrets", types.SimpleNamespace(randbelow=random.Random(SALT_SEED).randrange))


@pytest.fixture
async def gumbel_users(
    app: Any, db_session: AsyncSession, monkeypatch: pytest.MonkeyPatch, ready: None, seeded_message_ids: Any
) -> tuple[CreatedUser, CreatedUser, CreatedUser]:
    """v2 as the only usable, active, ``gumbel`` version (b = 32, d = 8, S = 16), and an author, another user and an
    auditor with IDs of its length; rolled back with the test (the keyring is reloaded then). After
    ``ready``: the app's start-up tasks (the registry cache's warm-up) share the test's connection,
    and one still reading there would roll its savepoint, and these writes in it, back. Their
    message IDs come from the seeded allocation (``seeded_message_ids``); the answers below are
    seeded (``seed``) or their salts are (``seeded_salts``): one outcome on every run."""
    resources = app.state.resources
    monkeypatch.setattr(resources.registry_cache, "check_interval", 0.0)  # sees this transaction's users
    # the configured secret v2 becomes the only active version, as a ``gumbel`` one
    await make_only_active_version(db_session, "v2", S2, KeyVersionSpec(GUMBEL))
    rows = [(r.name, r.status, r.scheme) for r in (await db_session.scalars(select(KeyVersion))).all()]
    await resources.keyring.refresh(db_session)
    assert sorted(rows) == [("v1", "retired", "xmark"), ("v2", "active", "gumbel")], rows
    assert [(h.name, h.key.params) for h in resources.keyring.usable()] == [("v2", GUMBEL)]
    users = UserService(Repositories(db_session), GUMBEL, resources.api_key_hasher)
    author = await users.create_user("gumbel-author", "user")
    other = await users.create_user("gumbel-other", "user")
    auditor = await users.create_user("gumbel-auditor", "auditor")
    for created in (author, other, auditor):
        assert [(m.bits, m.block_bits) for m in created.message_ids] == [(32, 8)]
    await db_session.flush()
    return author, other, auditor


@pytest.mark.model
async def test_an_answer_sampled_with_the_key_is_traced_to_its_author(
    app: Any, client: httpx.AsyncClient, gumbel_users: tuple[CreatedUser, CreatedUser, CreatedUser]
) -> None:
    author, other, auditor = gumbel_users
    assert await app.state.resources.backend.wait_ready(180)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}],
        "max_tokens": 160,
        "temperature": 1.0,
        "seed": 7,
    }
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(author.api_key))
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert len(text.split()) > 40

    traced = await client.post("/trace", json={"text": text, "model": MODEL}, headers=_auth(auditor.api_key))
    assert traced.status_code == 200, traced.text
    report = traced.json()
    assert report["watermarked"] is True and report["key_version"] == "v2"
    assert report["attribution"] is not None and report["attribution"]["user_id"] == author.id
    assert report["candidates"][0]["user_id"] == author.id
    assert len(report["blocks"]) == 4 and all(len(b["counts"]) == 256 for b in report["blocks"])

    # the other user's answer to the same prompt is theirs, not the author's
    again = await client.post("/v1/chat/completions", json=body, headers=_auth(other.api_key))
    assert again.status_code == 200, again.text
    theirs = again.json()["choices"][0]["message"]["content"]
    assert theirs != text
    traced = await client.post("/trace", json={"text": theirs, "model": MODEL}, headers=_auth(auditor.api_key))
    attribution = traced.json()["attribution"]
    assert attribution is None or attribution["user_id"] == other.id


@pytest.mark.model
@pytest.mark.usefixtures("seeded_salts")
async def test_one_users_answers_to_one_prompt_differ_and_each_names_them(
    app: Any, client: httpx.AsyncClient, gumbel_users: tuple[CreatedUser, CreatedUser, CreatedUser]
) -> None:
    """The same user and prompt twice without a seed, then n = 2 in one request: consecutive salts, so
    four different answers (without salts the key fixes the answer). With the same ``seed`` twice,
    the same answer (the seed fixes the salt and the sampling); answers of four seeds are each
    traced to the user, and the signed report names the salts its p-values counted."""
    author, _, auditor = gumbel_users
    assert await app.state.resources.backend.wait_ready(180)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a walk through a forest in autumn."}],
        "max_tokens": 120,
        "temperature": 0.7,
    }
    texts = []
    for extra in ({}, {}, {"n": 2}):
        response = await client.post("/v1/chat/completions", json={**body, **extra}, headers=_auth(author.api_key))
        assert response.status_code == 200, response.text
        texts.extend(choice["message"]["content"] for choice in response.json()["choices"])
    assert len(texts) == 4 and len(set(texts)) == 4
    seeded = []
    for _ in range(2):
        response = await client.post(
            "/v1/chat/completions", json={**body, "seed": 11, "max_tokens": 40}, headers=_auth(author.api_key)
        )
        assert response.status_code == 200, response.text
        seeded.append(response.json()["choices"][0]["message"]["content"])
    assert seeded[0] == seeded[1]
    # the naming is checked on answers of fixed seeds (each seed its own salt and sampling), so the
    # outcome is the same every run: the unseeded answers above draw their sampling afresh, and a
    # 120-token answer's rare miss would make this test fail at random
    named = []
    for seed in (1, 2, 3, 4):
        response = await client.post("/v1/chat/completions", json={**body, "seed": seed}, headers=_auth(author.api_key))
        assert response.status_code == 200, response.text
        named.append(response.json()["choices"][0]["message"]["content"])
    assert len(set(named)) == 4
    for text in named:
        traced = await client.post("/trace", json={"text": text, "model": MODEL}, headers=_auth(auditor.api_key))
        assert traced.status_code == 200, traced.text
        report = traced.json()
        assert report["attribution"] is not None and report["attribution"]["user_id"] == author.id, (
            report["decoder"],
            report["p_value"],
        )
    document = (await client.get(f"/trace/{report['report_id']}", headers=_auth(auditor.api_key))).json()
    assert document["report"]["params"]["salts"] == 16


async def test_requests_it_cannot_honour_are_refused_by_name(
    app: Any, client: httpx.AsyncClient, gumbel_users: tuple[CreatedUser, CreatedUser, CreatedUser]
) -> None:
    author, _, _ = gumbel_users
    assert await app.state.resources.backend.wait_ready(180)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    response = await client.post("/v1/chat/completions", json={**base, "temperature": 0}, headers=_auth(author.api_key))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "temperature" and error["code"] == "unsupported_value"
    assert "distortion-free" in error["message"]
    # the same fields on the text-completion endpoint
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 0},
        headers=_auth(author.api_key),
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    # a temperature above 0 with top_p left at 1 is served
    fine = await client.post(
        "/v1/chat/completions", json={**base, "temperature": 0.7, "top_p": 1}, headers=_auth(author.api_key)
    )
    assert fine.status_code == 200, fine.text


@pytest.mark.model
async def test_a_nucleus_request_is_sampled_with_the_key_within_it(
    app: Any, client: httpx.AsyncClient, gumbel_users: tuple[CreatedUser, CreatedUser, CreatedUser]
) -> None:
    """top_p < 1: the keyed sampler draws inside the request's nucleus (xmark_core.gumbel.truncate_),
    so the answer is served, and traced to its author, instead of refused."""
    author, _, auditor = gumbel_users
    assert await app.state.resources.backend.wait_ready(180)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}],
        "max_tokens": 160,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 5,
    }
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(author.api_key))
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert len(text.split()) > 40
    traced = await client.post("/trace", json={"text": text, "model": MODEL}, headers=_auth(auditor.api_key))
    assert traced.status_code == 200, traced.text
    report = traced.json()
    assert report["watermarked"] is True
    assert report["attribution"] is not None and report["attribution"]["user_id"] == author.id


async def test_vllm_workers_serve_the_scheme_with_the_fields_they_can_honour(tmp_path: Any) -> None:
    """The vLLM backend serves ``gumbel`` versions (its workers' processors sample with the key): it
    passes the start-up check; the sampling fields a worker applies after its processors, and n > 1
    (vLLM's child requests would share one salt), are refused by name. A backend without the scheme
    (a biasing-only one) is refused at start-up and per request (503 ``scheme_not_served``)."""
    settings = make_test_settings(
        tmp_path,
        backend="vllm",
        vllm_urls=["http://127.0.0.1:9"],
        model_path=None,
        watermark_scheme="gumbel",
        watermark_block_bits=8,
        watermark_num_keys=1,
    )
    params = params_from_settings(settings)
    assert params == replace(GUMBEL, bits=64)  # the default length; 16 salts unless XMARK_WATERMARK_SALTS says so
    assert params_from_settings(settings.model_copy(update={"watermark_salts": 1})).salts == 1
    with pytest.raises(ValidationError, match="salts applies to scheme 'gumbel' only"):  # at start-up
        make_test_settings(tmp_path, watermark_salts=4)
    from service.schemas.chat import ChatCompletionRequest

    def body(**fields: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
        )

    backend = build_backend(settings, Metrics())
    try:
        assert "gumbel" in backend.schemes and not backend.salts_per_answer
        _check_scheme_served(Keyring(params, {}), settings.model_name, backend)
        served = ServedModel(settings.model_name, backend, None, ())
        check_keyed_sampling("v9", "gumbel", served, body(temperature=0.7), {"presence_penalty": 0, "top_k": -1})
        # the nucleus fields its workers apply before the choice pass
        check_keyed_sampling("v9", "gumbel", served, body(temperature=0.7, top_p=0.9), {"top_k": 40, "min_p": 0.05})
        for options, param in (
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"repetition_penalty": 1.1}, "repetition_penalty"),
            ({"frequency_penalty": -0.3}, "frequency_penalty"),
            ({"logit_bias": {"42": 5}}, "logit_bias"),
        ):
            with pytest.raises(InvalidRequestError) as refused:
                check_keyed_sampling("v9", "gumbel", served, body(), options)
            assert refused.value.param == param and refused.value.code == "unsupported_value"
        with pytest.raises(InvalidRequestError) as refused:
            check_keyed_sampling("v9", "gumbel", served, body(n=2))
        assert refused.value.param == "n" and "send n requests" in refused.value.message
        # the local backend writes a request's n answers under consecutive salts: n > 1 passes there
        local = ServedModel("local", FakeBackend("local"), None, ())
        check_keyed_sampling("v9", "gumbel", local, body(n=2))
    finally:
        await backend.close()
    biasing_only = FakeBackend("old")
    biasing_only.schemes = frozenset({"xmark", "loso", "mpac"})
    with pytest.raises(ConfigurationError, match="does not serve the watermark scheme 'gumbel'"):
        _check_scheme_served(Keyring(params, {}), "old", biasing_only)
    _check_scheme_served(
        Keyring(replace(GUMBEL, scheme="xmark", block_bits=2, num_keys=4, salts=1), {}), "old", biasing_only
    )
    with pytest.raises(ServiceUnavailableError) as caught:
        check_keyed_sampling("v9", "gumbel", ServedModel("old", biasing_only, None, ()), body())
    assert caught.value.code == "scheme_not_served" and "v9" in caught.value.message
