"""/trace's likelihood decoder on the local backend: the model's scores, the decoder option, the report."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import InvalidRequestError, ServiceUnavailableError
from service.models import Trace
from service.services.reports import decode_public_key, verify_report
from service.trace.analysis import tokenize
from tests.service.trace.test_trace import _auth, _watermarked_text

# the verdicts depend on the users' message IDs (what is written, what it is told apart from):
# drawn from a seeded generator (tests/service/conftest.py), with the answers' sampling seeded
# (``_watermarked_text``, seed=3 below), they give one outcome on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]

PLAIN = (
    "Sailing ships carried goods and people across the oceans for centuries. Their hulls were built "
    "of oak, their sails of canvas, and their crews learned to read the wind and the stars."
)


async def test_scores_are_the_models_log_probabilities(app: Any, ready: None) -> None:
    backend = app.state.resources.backend
    ids = tokenize(backend.tokenizer, PLAIN)
    short = ids[:12]
    scores, alone = await asyncio.gather(backend.score(ids, 20), backend.score(short, 20))  # one batch
    assert scores.top_ids.shape == (len(ids), 20) and scores.token_logprobs.shape == (len(ids),)
    assert np.isnan(scores.token_logprobs[0]) and np.isfinite(scores.token_logprobs[1:]).all()
    assert (np.diff(scores.top_logprobs[1:], axis=1) <= 0).all()  # descending
    following = torch.tensor(ids[1:])[:, None]

    def own_logprobs(model: Any) -> np.ndarray:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0]  # [n, V]
        return torch.log_softmax(logits.float(), dim=-1)[:-1].gather(1, following)[:, 0].double().numpy()

    # exactly the scoring model's forward pass (float32, or bfloat16 where the CPU has it: auto)
    np.testing.assert_allclose(scores.token_logprobs[1:], own_logprobs(backend._scorer), atol=1e-4)
    # and within bfloat16's rounding of the served float32 model
    gap = np.abs(scores.token_logprobs[1:] - own_logprobs(backend._model))
    assert gap.max() < 0.5 and float(np.median(gap)) < 0.1, (gap.max(), np.median(gap))
    bf16 = next(backend._scorer.parameters()).dtype == torch.bfloat16
    # a text scored beside a longer one (right padding) reads the same as its own prefix
    np.testing.assert_allclose(alone.token_logprobs[1:], scores.token_logprobs[1:12], atol=0.05 if bf16 else 1e-4)
    assert (alone.top_ids[1:] == scores.top_ids[1:12]).mean() > (0.9 if bf16 else 0.99)
    assert scores.vocab_size == len(backend.tokenizer)


async def test_likelihood_decoder_names_the_author_and_explains_each_token(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, ready: None
) -> None:
    _, auditor = await make_user("auditor")
    author, _ = await make_user("user")
    text = await _watermarked_text(app, author["message_id"], tokens=200)
    response = await client.post(
        "/trace", json={"text": text, "decoder": "likelihood", "include_tokens": True}, headers=_auth(auditor)
    )
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["decoder"] == "likelihood" and report["test"].startswith("likelihood")
    assert report["temperature"] == app.state.resources.settings.trace_temperature
    assert report["edit_rate"] == app.state.resources.settings.trace_edit_rate == 0.01
    assert report["attribution"] is not None and report["attribution"]["user_id"] == author["user_id"]
    assert report["watermarked"] is True and report["p_value"] < 1e-3
    assert report["confidence"] >= 0.99 and report["margin"] > 0
    assert all(len(block["scores"]) == 4 for block in report["blocks"])
    evidence = [t["llr"] for t in report["tokens"] if t["llr"] is not None]
    assert len(evidence) == report["scored_tokens"] and sum(evidence) == pytest.approx(report["statistic"], rel=1e-6)
    row = (await db_session.execute(select(Trace).order_by(Trace.id.desc()).limit(1))).scalar_one()
    assert row.decoder == "likelihood" and row.attributed_user_id == author["user_id"]


async def test_auto_escalates_on_text_counting_cannot_name_and_names_nobody_on_plain_text(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    _, auditor = await make_user("auditor")
    for _ in range(3):
        await make_user("user")
    # Plain text is named with probability at most alpha (the test is valid, not infallible); at
    # alpha = 1e-6 this test fails with probability at most 1e-6 while still checking the path.
    resources = app.state.resources
    default = resources.settings
    resources.settings = default.model_copy(update={"trace_alpha": 1e-6})
    try:
        response = await client.post("/trace", json={"text": PLAIN}, headers=_auth(auditor))
        counting_response = await client.post(
            "/trace", json={"text": PLAIN, "decoder": "counting"}, headers=_auth(auditor)
        )
    finally:
        resources.settings = default
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["decoder"] == "likelihood"  # counting named nobody, so the model read it too
    assert report["attribution"] is None and report["watermarked"] is False
    counting = counting_response.json()
    assert counting["decoder"] == "counting" and counting["temperature"] is None
    assert counting["attribution"] is None and all(b["scores"] is None for b in counting["blocks"])
    assert all(len(b["scores"]) == 4 for b in report["blocks"])  # the likelihood reading is in the report


async def test_auto_keeps_the_counting_verdict_when_it_names_someone(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    _, auditor = await make_user("auditor")
    author, _ = await make_user("user")
    text = await _watermarked_text(app, author["message_id"])  # 400 tokens: counting names the author
    report = (await client.post("/trace", json={"text": text}, headers=_auth(auditor))).json()
    assert report["decoder"] == "counting" and report["attribution"]["user_id"] == author["user_id"]


async def test_likelihood_refuses_a_text_longer_than_its_limit_by_name(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    _, auditor = await make_user("auditor")
    resources = app.state.resources
    default = resources.settings
    resources.settings = default.model_copy(update={"trace_likelihood_max_tokens": 8})
    try:
        refused = await client.post("/trace", json={"text": PLAIN, "decoder": "likelihood"}, headers=_auth(auditor))
        auto = await client.post("/trace", json={"text": PLAIN}, headers=_auth(auditor))
    finally:
        resources.settings = default
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "decoder"
    assert auto.status_code == 200 and auto.json()["decoder"] == "counting"  # too long to escalate
    bad = await client.post("/trace", json={"text": PLAIN, "decoder": "bayes"}, headers=_auth(auditor))
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "decoder"


async def test_auto_falls_back_to_counting_when_the_model_cannot_score(
    app: Any, client: httpx.AsyncClient, make_user: Any, monkeypatch: pytest.MonkeyPatch, ready: None
) -> None:
    """A worker with a shorter context (400) or one that is gone (503): counting decides, and an
    explicit likelihood request gets the error."""
    _, auditor = await make_user("auditor")
    backend = app.state.resources.backend
    for error in (
        InvalidRequestError("The text has 9 tokens; the model reads at most 4", param="text"),
        ServiceUnavailableError("The model backend is unavailable"),
    ):

        async def refuse(token_ids: Any, top_k: int, error: Exception = error) -> Any:
            raise error

        monkeypatch.setattr(backend, "score", refuse)
        auto = await client.post("/trace", json={"text": PLAIN}, headers=_auth(auditor))
        assert auto.status_code == 200 and auto.json()["decoder"] == "counting"
        explicit = await client.post("/trace", json={"text": PLAIN, "decoder": "likelihood"}, headers=_auth(auditor))
        assert explicit.status_code == error.status_code


async def test_an_identity_level_names_after_the_identity_test_and_is_signed(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    """A request's identity level: the likelihood decoder names after the identity test, and the
    signed report holds the level and the p-value (and verifies)."""
    _, auditor = await make_user("auditor")
    author, _ = await make_user("user")
    for _ in range(3):
        await make_user("user")
    text = await _watermarked_text(app, author["message_id"], tokens=200)
    response = await client.post("/trace", json={"text": text, "identity_level": 0.01}, headers=_auth(auditor))
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["decoder"] == "likelihood"  # auto: only the likelihood decoder names under the test
    assert report["identity_level"] == 0.01
    assert report["identity_p_value"] is not None and report["identity_p_value"] <= 0.01
    assert report["attribution"] is not None and report["attribution"]["user_id"] == author["user_id"]
    document = (await client.get(f"/trace/{report['report_id']}", headers=_auth(auditor))).json()
    signed = document["report"]
    assert signed["decoder_settings"]["identity_level"] == 0.01
    assert signed["identity_p_value"] == report["identity_p_value"]
    key = (await client.get("/.well-known/xmark-report-key")).json()
    assert verify_report(document, decode_public_key(key["public_key"])) == signed
    plain = (await client.post("/trace", json={"text": text, "decoder": "likelihood"}, headers=_auth(auditor))).json()
    assert plain["identity_level"] is None and plain["identity_p_value"] is None
    unsigned_fields = (await client.get(f"/trace/{plain['report_id']}", headers=_auth(auditor))).json()["report"]
    assert "identity_p_value" not in unsigned_fields and "identity_level" not in unsigned_fields["decoder_settings"]


async def test_the_gateways_identity_level_can_be_tightened_never_loosened_or_dropped(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    _, auditor = await make_user("auditor")
    author, _ = await make_user("user")
    text = await _watermarked_text(app, author["message_id"])  # 400 tokens: counting alone names the author
    resources = app.state.resources
    default = resources.settings
    resources.settings = default.model_copy(update={"trace_identity_level": 0.05})
    try:
        gateway = await client.post("/trace", json={"text": text}, headers=_auth(auditor))
        stricter = await client.post("/trace", json={"text": text, "identity_level": 0.001}, headers=_auth(auditor))
        looser = await client.post("/trace", json={"text": text, "identity_level": 0.2}, headers=_auth(auditor))
        counting = await client.post("/trace", json={"text": text, "decoder": "counting"}, headers=_auth(auditor))
    finally:
        resources.settings = default
    assert gateway.status_code == 200, gateway.text
    assert gateway.json()["decoder"] == "likelihood" and gateway.json()["identity_level"] == 0.05
    assert gateway.json()["attribution"]["user_id"] == author["user_id"]
    assert stricter.status_code == 200 and stricter.json()["identity_level"] == 0.001
    assert looser.status_code == 400 and looser.json()["error"]["param"] == "identity_level"
    assert "stricter" in looser.json()["error"]["message"]
    assert counting.status_code == 400 and counting.json()["error"]["param"] == "decoder"


async def test_an_identity_level_without_the_model_is_a_503_not_counting_s_name(
    app: Any, client: httpx.AsyncClient, make_user: Any, monkeypatch: pytest.MonkeyPatch, ready: None
) -> None:
    _, auditor = await make_user("auditor")
    author, _ = await make_user("user")
    text = await _watermarked_text(app, author["message_id"])

    async def gone(token_ids: Any, top_k: int) -> Any:
        raise ServiceUnavailableError("The model backend is unavailable")

    monkeypatch.setattr(app.state.resources.backend, "score", gone)
    response = await client.post("/trace", json={"text": text, "identity_level": 0.01}, headers=_auth(auditor))
    assert response.status_code == 503, response.text
    assert (await client.post("/trace", json={"text": text}, headers=_auth(auditor))).json()["decoder"] == "counting"


async def test_the_local_backend_encodes_with_the_entropy_rule_and_the_decoder_reads_it(app: Any, ready: None) -> None:
    """A key version with the entropy rule (h = 0.69 nats: no bias where the model's top token has
    probability above 1/2): on the served model's answer, the positions the rule skipped carry the
    hash's own boosted share, the others far more, and the likelihood decoder names the message."""
    from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
    from tests.service.trace.test_trace import ESSAY
    from xmark_core import Message, WatermarkParams, score_text
    from xmark_core.likelihood import boosted_share, naming_test

    backend = app.state.resources.backend
    keyring = app.state.resources.keyring
    active = keyring.active()
    params = WatermarkParams(**{**active.key.params.to_dict(), "min_entropy": 0.69})
    key = keyring.key_for(active.name, params)
    message = Message.from_bits("01" * (params.bits // 2), params)
    request = GenerationRequest((ChatTurn("user", ESSAY),), max_tokens=300, temperature=0.8, seed=3)
    text = (await backend.generate(request, WatermarkStamp(key, message))).choices[0].text
    ids = tokenize(backend.tokenizer, text)
    assert len(ids) > 150
    scores = await backend.score(ids, 20)
    result = score_text(ids, scores, key)
    assert naming_test(result, message.blocks)[0] < 1e-4
    hits = result.boosted[np.arange(result.rows.size), message.blocks[result.rows]]
    skipped = -scores.top_logprobs[result.positions].max(axis=1) < params.min_entropy
    assert skipped.sum() >= 30 and (~skipped).sum() >= 30, skipped.sum()
    gamma = boosted_share(params)
    # the scorer reads the text without its prompt (and perhaps in bfloat16): a few positions are
    # judged otherwise than the encoder judged them, so the skipped share sits near gamma, not on it
    assert float(hits[skipped].mean()) < gamma + 0.15
    assert float(hits[~skipped].mean()) > gamma + 0.3
    assert (result.weights[skipped] == 0.0).all()
