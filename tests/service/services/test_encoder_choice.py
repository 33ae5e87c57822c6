"""A per-request key version (``XMARK_WATERMARK_SCHEME=auto``): two encoders under one secret, the
distortion-free keyed sampler where the request leaves the model a choice and the paper's XMark bias
everywhere else. Nothing is refused for the watermark's sake: greedy, low-temperature, narrow-nucleus
and penalised requests are answered under the biasing encoder, the record says which encoder wrote
each answer, and ``/trace`` reads both encoders and names the author whichever wrote the text."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import InvalidRequestError
from service.fleet import ServedModel
from service.keyring import Keyring, KeyringError, KeyVersionHandle
from service.models import Generation, KeyVersion
from service.repositories.unit import Repositories
from service.schemas.admin import CreatedUser
from service.schemas.chat import ChatCompletionRequest
from service.services.encoder_choice import EncoderRule, choose_encoder, companion_reason
from service.trace.analysis import LengthGroup, analyze_counting_by_length, group_by_length
from service.trace.plan import CandidateScope, CandidateSet, FanoutPlan
from service.trace.policy import TracePolicy
from service.vocabulary import KeyVersionStatus, TraceDecoder
from tests.conftest import TEST_WATERMARK_SECRETS
from tests.service.conftest import make_only_active_version
from xmark_core import CandidateSet as Candidates
from xmark_core import MessageAllocator, WatermarkKey
from xmark_core.encoders import COMPANION_DELTA, KeyVersionSpec, companion_key, encoder_keys, spec_for

SPEC = spec_for("auto")
GUMBEL, XMARK = SPEC.encoders
MODEL = "smollm2-135m-instruct"
S2 = TEST_WATERMARK_SECRETS["v2"].encode()
RULE = EncoderRule(min_temperature=0.5, min_top_p=0.5)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- the rule ---------------------------------------------------------------------------------


@dataclass
class _Backend:
    """What the rule reads of a backend."""

    salts_per_answer: bool = True
    encoders_per_request: bool = True
    schemes: frozenset[str] = field(default_factory=lambda: frozenset({"gumbel", "xmark"}))


def _served(**backend: Any) -> ServedModel:
    return ServedModel("m", _Backend(**backend), None, ())  # type: ignore[arg-type]  # the rule's view of one


def _body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def _handle(spec: KeyVersionSpec = SPEC) -> KeyVersionHandle:
    primary, *companion = encoder_keys(S2, spec)
    return KeyVersionHandle(1, "v2", primary, KeyVersionStatus.ACTIVE, companion[0] if companion else None)


@pytest.mark.parametrize(
    ("fields", "options", "reason"),
    [
        ({"temperature": 0}, {}, "temperature"),
        ({"temperature": 0.2}, {}, "temperature"),
        ({"temperature": 0.49}, {}, "temperature"),
        ({"temperature": 0.5}, {}, ""),
        ({}, {}, ""),  # OpenAI's default temperature, 1
        ({"temperature": 1.3}, {}, ""),
        ({"temperature": 1.0, "top_p": 0.3}, {}, "top_p"),
        ({"temperature": 1.0, "top_p": 0.9}, {}, ""),
        ({"temperature": 1.0}, {"top_k": 1}, "top_k"),
        ({"temperature": 1.0}, {"top_k": 40}, ""),
        ({"temperature": 0.7}, {"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"temperature": 0.7}, {"presence_penalty": -0.2}, "presence_penalty"),
        ({"temperature": 0.7}, {"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"temperature": 0.7}, {"logit_bias": {"17": -100}}, "logit_bias"),
        ({"temperature": 0.7}, {"presence_penalty": 0, "logit_bias": {}}, ""),  # neutral values
    ],
)
def test_the_rule_names_the_field_that_sends_a_request_to_the_biasing_encoder(
    fields: dict[str, Any], options: dict[str, Any], reason: str
) -> None:
    served = _served()
    assert companion_reason(_body(**fields), options, served=served, rule=RULE) == reason
    choice = choose_encoder(_handle(), served, _body(**fields), options, rule=RULE)
    assert choice.companion is bool(reason) and choice.reason == reason
    assert choice.key.params == (XMARK if reason else GUMBEL)


def test_n_above_one_goes_to_the_biasing_encoder_only_where_answers_would_share_a_salt() -> None:
    assert companion_reason(_body(n=2), {}, served=_served(salts_per_answer=False), rule=RULE) == "n"
    assert companion_reason(_body(n=2), {}, served=_served(salts_per_answer=True), rule=RULE) == ""


def test_the_threshold_is_the_operators() -> None:
    body = _body(temperature=0.7)
    assert companion_reason(body, {}, served=_served(), rule=EncoderRule(min_temperature=0.8, min_top_p=0.5))
    assert not companion_reason(body, {}, served=_served(), rule=EncoderRule(min_temperature=0.6, min_top_p=0.5))


def test_a_backend_serving_the_primary_alone_keeps_the_distortion_free_refusals() -> None:
    served = _served(encoders_per_request=False)
    with pytest.raises(InvalidRequestError) as refused:
        choose_encoder(_handle(), served, _body(temperature=0), {}, rule=RULE)
    assert refused.value.param == "temperature"
    assert not choose_encoder(_handle(), served, _body(temperature=0.7), {}, rule=RULE).companion


def test_a_single_scheme_version_has_one_encoder_for_every_request() -> None:
    biasing = _handle(spec_for("xmark"))
    for fields in ({"temperature": 0}, {"temperature": 1.0}):
        choice = choose_encoder(biasing, _served(), _body(**fields), {"frequency_penalty": 1}, rule=RULE)
        assert not choice.companion and choice.key.params.scheme == "xmark"
    with pytest.raises(InvalidRequestError):
        choose_encoder(_handle(spec_for("gumbel")), _served(), _body(temperature=0), {}, rule=RULE)


# -- keys -------------------------------------------------------------------------------------


def test_the_companion_has_keys_of_its_own() -> None:
    """The companion's hash keys derive under a label of their own: neither the primary's nor those
    the same parameters get from the secret directly (a version of the single scheme xmark)."""
    primary, companion = encoder_keys(S2, SPEC)
    assert primary.params == GUMBEL and companion.params == XMARK
    plain = WatermarkKey.from_secret(S2, XMARK)
    assert companion.fingerprint != plain.fingerprint
    assert not np.array_equal(companion.words, plain.words)
    assert not set(companion.words.ravel().tolist()) & set(primary.words.ravel().tolist())
    assert companion_key(S2, XMARK).fingerprint == companion.fingerprint  # deterministic


async def test_a_per_request_version_registers_both_encoders_and_checks_both(db_session: AsyncSession) -> None:
    await db_session.execute(update(KeyVersion).values(status="retired"))
    keyring = Keyring(SPEC, {"auto-1": S2})
    await keyring.sync(db_session)
    row = (await db_session.scalars(select(KeyVersion).where(KeyVersion.name == "auto-1"))).one()
    primary, companion = encoder_keys(S2, SPEC)
    assert (row.scheme, row.block_bits, row.salts, row.fingerprint) == ("gumbel", 8, 16, primary.fingerprint)
    assert (row.companion_scheme, row.companion_block_bits, row.companion_num_keys) == ("xmark", 2, 4)
    assert row.companion_fingerprint == companion.fingerprint
    [handle] = keyring.usable()
    assert handle.per_request and handle.companion is not None
    readings = keyring.readings()
    assert [(h.name, h.encoder, h.is_companion) for h in readings] == [
        ("auto-1", "gumbel", False),
        ("auto-1", "xmark", True),
    ]
    assert keyring.lengths() == {(32, 8), (32, 2)}
    # a companion fingerprint that does not match the secret stops the start-up
    row.companion_fingerprint = "0" * 64
    await db_session.flush()
    with pytest.raises(KeyringError, match="auto-1"):
        await Keyring(SPEC, {"auto-1": S2}).sync(db_session)


# -- /trace's count ---------------------------------------------------------------------------


def test_each_encoder_is_one_more_test_of_the_trace() -> None:
    """The fan-out counts a per-request version's two readings as two key versions: tries doubles."""
    handle = _handle()

    def plan(handles: list[KeyVersionHandle]) -> FanoutPlan:
        groups = tuple(LengthGroup(g, None) for g in group_by_length(handles))  # type: ignore[arg-type]
        return FanoutPlan((CandidateSet(CandidateScope.REGISTRY, groups),), (TraceDecoder.COUNTING,))

    one = plan(list(handle.encoders())[:1])
    both = plan(list(handle.encoders()))
    assert both.tries == 2 * one.tries
    assert [len(g.versions) for g in both.candidate_sets[0].groups] == [1, 1]  # one length each


def test_null_texts_read_under_both_encoders_are_detected_at_most_at_the_level() -> None:
    """Calibration over the new dimension: texts no one watermarked (uniform token ids), read under
    both encoders of a per-request version (500 registered users each) with the count the fan-out
    gives (2 tests). The report's verdict is a family-wise test: watermarked (or named) at most at
    alpha. At alpha = 0.2 over 300 texts the count is Binomial(300, <= 0.2); the bound (its 0.999
    quantile) fails with probability < 0.1 % when calibrated, and a trace that did not pay for the
    second encoder (each reading at level alpha: family rate about 0.33 here) exceeds it with
    probability about 98 %. Seeded (the texts and the users' IDs), so the count is the same on every
    run."""
    from scipy.stats import binom

    from service.services.registry_cache import RegisteredUser, RegistrySnapshot

    rng = np.random.default_rng(20261201)
    id_rng = random.Random(20261201)  # the users' IDs: the product's allocation rule, seeded
    groups = []
    for encoder in _handle().encoders():
        params = encoder.key.params
        allocator = MessageAllocator([], params, id_rng)
        bits = [allocator.allocate().bits for _ in range(500)]
        candidates = Candidates(bits, list(range(1, 501)), params)
        users = {i: RegisteredUser(i, f"u{i}", "active") for i in range(1, 501)}
        groups.append(LengthGroup((encoder,), RegistrySnapshot(candidates, users)))
    multiplicity = FanoutPlan(
        (CandidateSet(CandidateScope.REGISTRY, tuple(groups)),), (TraceDecoder.COUNTING,)
    ).multiplicity
    assert multiplicity.tries == 2 and multiplicity.encoders == (2,)

    class _Tokenizer:
        all_special_ids: tuple[int, ...] = ()

    alpha, texts = 0.2, 300
    detected = named = 0
    for _ in range(texts):
        ids = rng.integers(0, 49_152, size=150).tolist()
        outcome = analyze_counting_by_length(
            ids, _Tokenizer(), groups, policy=TracePolicy(alpha=alpha), multiplicity=multiplicity
        )  # type: ignore[arg-type]
        detected += outcome.report.watermarked
        named += outcome.named
    bound = int(binom.ppf(0.999, texts, alpha))
    assert detected <= bound, f"{detected} of {texts} null texts called watermarked at alpha {alpha} (bound {bound})"
    assert named <= detected


# -- end to end on the real model -------------------------------------------------------------


@pytest.fixture
async def auto_users(
    app: Any, db_session: AsyncSession, monkeypatch: pytest.MonkeyPatch, ready: None, seeded_message_ids: Any
) -> tuple[CreatedUser, CreatedUser]:
    """v2 as the only usable, active version, a per-request one (gumbel 32/8 with 16 salts and its
    xmark companion 32/2, k = 4), and an author and an auditor with IDs of both lengths; rolled back
    with the test (the keyring is reloaded then). Their IDs come from the seeded allocation
    (``seeded_message_ids``) and the answers traced below are seeded (``seed``): the same texts,
    the same verdicts, on every run."""
    resources = app.state.resources
    monkeypatch.setattr(resources.registry_cache, "check_interval", 0.0)
    await make_only_active_version(db_session, "v2", S2, SPEC)
    await resources.keyring.refresh(db_session)
    assert [(h.name, h.per_request) for h in resources.keyring.usable()] == [("v2", True)]
    from service.services.users import UserService

    users = UserService(Repositories(db_session), SPEC, resources.api_key_hasher)
    author = await users.create_user("auto-author", "user")
    auditor = await users.create_user("auto-auditor", "auditor")
    for created in (author, auditor):
        assert sorted((m.bits, m.block_bits) for m in created.message_ids) == [(32, 2), (32, 8)]
    await db_session.flush()
    return author, auditor


@pytest.mark.model
async def test_every_temperature_is_answered_marked_and_traced_to_its_author(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, auto_users: tuple[CreatedUser, CreatedUser]
) -> None:
    """Greedy, 0.2, 0.7 with a frequency penalty and 1.0: all answered (none refused), the first three
    by the biasing encoder and the last by the distortion-free one, as the records say; each text
    traced to its author by the reading of the encoder that wrote it."""
    author, auditor = auto_users
    assert await app.state.resources.backend.wait_ready(180)
    prompt = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
    cells: list[tuple[float, dict[str, Any], str]] = [
        (0, {}, "xmark"),
        (0.2, {}, "xmark"),
        (0.7, {"frequency_penalty": 0.5}, "xmark"),
        (1.0, {}, "gumbel"),
    ]
    for temperature, extra, encoder in cells:
        body = {"model": MODEL, "messages": prompt, "max_tokens": 150, "temperature": temperature, "seed": 3, **extra}
        response = await client.post("/v1/chat/completions", json=body, headers=_auth(author.api_key))
        assert response.status_code == 200, (temperature, response.text)
        data = response.json()
        text = data["choices"][0]["message"]["content"]
        row = (await db_session.scalars(select(Generation).where(Generation.request_id == data["id"]))).one()
        assert row.encoder == encoder, temperature
        traced = await client.post("/trace", json={"text": text, "model": MODEL}, headers=_auth(auditor.api_key))
        assert traced.status_code == 200, traced.text
        report = traced.json()
        assert report["attribution"] is not None and report["attribution"]["user_id"] == author.id, (
            temperature,
            report["p_value"],
        )
        assert report["encoder"] == encoder and report["key_version"] == "v2"
        if encoder == "xmark":
            assert report["sigma"] is not None and report["sigma"] > 0
        else:
            assert report["sigma"] is None
        document = (await client.get(f"/trace/{report['report_id']}", headers=_auth(auditor.api_key))).json()
        assert document["report"]["params"]["scheme"] == encoder
    # the biasing encoder at a temperature above 0: the same seed, the same answer; another seed, another
    answers = []
    for seed in (5, 5, 6):
        body = {"model": MODEL, "messages": prompt, "max_tokens": 30, "temperature": 0.3, "seed": seed}
        response = await client.post("/v1/chat/completions", json=body, headers=_auth(author.api_key))
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] != answers[2]


@pytest.mark.model
async def test_text_completions_honour_the_penalties_under_the_biasing_encoder(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, auto_users: tuple[CreatedUser, CreatedUser]
) -> None:
    """/v1/completions takes the penalties and logit_bias the local backend honours on chat: answered
    at temperature 1.0 by the biasing encoder (the penalties send it there), the record says so; a
    bad value is a 400 naming the field before anything is admitted or recorded."""
    author, _ = auto_users
    assert await app.state.resources.backend.wait_ready(180)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    sent = {**body, "frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {"42": -100}}
    response = await client.post("/v1/completions", json=sent, headers=_auth(author.api_key))
    assert response.status_code == 200, response.text
    row = (await db_session.scalars(select(Generation).where(Generation.request_id == response.json()["id"]))).one()
    assert row.encoder == "xmark"
    plain = await client.post("/v1/completions", json=body, headers=_auth(author.api_key))
    assert plain.status_code == 200, plain.text
    row = (await db_session.scalars(select(Generation).where(Generation.request_id == plain.json()["id"]))).one()
    assert row.encoder == "gumbel"
    before = len((await db_session.scalars(select(Generation))).all())
    for name, value in (("presence_penalty", 2.5), ("logit_bias", {"-1": 3})):
        refused = await client.post("/v1/completions", json={**body, name: value}, headers=_auth(author.api_key))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == (name, "invalid_value")
    assert len((await db_session.scalars(select(Generation))).all()) == before
    assert app.state.resources.backend._inbox.empty()


async def test_the_admin_api_shows_both_encoders(
    client: httpx.AsyncClient, admin_key: str, auto_users: tuple[CreatedUser, CreatedUser]
) -> None:
    response = await client.get("/admin/key-versions", headers=_auth(admin_key))
    assert response.status_code == 200, response.text
    [v2] = [v for v in response.json()["data"] if v["name"] == "v2"]
    primary, companion = encoder_keys(S2, SPEC)
    assert (v2["scheme"], v2["block_bits"], v2["salts"], v2["fingerprint"]) == ("gumbel", 8, 16, primary.fingerprint)
    assert v2["companion"] == {
        "scheme": "xmark",
        "block_bits": 2,
        "num_keys": 4,
        "delta": COMPANION_DELTA,
        "min_entropy": 0.0,
        "fingerprint": companion.fingerprint,
    }
