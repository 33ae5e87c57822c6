"""POST /trace: roles, validation, the report, attribution (tombstones included), key versions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.models import Trace, User
from service.services import registry_cache
from service.services.registry_cache import RegistryCache
from xmark_core import Message, decode, detect

# the verdicts depend on the users' message IDs (what is written, what it is told apart from):
# drawn from a seeded generator (tests/service/conftest.py), they give one outcome on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]

MODEL = "smollm2-135m-instruct"
ESSAY = "Write a detailed essay about the history of sailing ships, with many facts."


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _trace_count(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.count()).select_from(Trace)) or 0)


async def _watermarked_text(app: Any, message_bits: str, *, key_version: str | None = None, tokens: int = 400) -> str:
    # 400 tokens: the detection verdict (a test over all 2**b messages at alpha = 1e-3) is not
    # guaranteed on a single 200-token answer; attribution among a few users is far more sensitive.
    keyring = app.state.resources.keyring
    handle = keyring.active() if key_version is None else next(h for h in keyring.usable() if h.name == key_version)
    stamp = WatermarkStamp(handle.key, Message.from_bits(message_bits, handle.key.params))
    backend = app.state.resources.backend
    # The answer depends on the message ID: one may stop early (about 1 in 20 at seed 7) or loop on
    # a few repeated contexts, and then carry too little watermark for a verdict at alpha = 1e-3
    # over every key version tried. These tests are about what /trace does with a text that carries
    # its watermark (the power on one answer is measured by the benchmarks), so the next seed
    # writes another answer until the library's own detector finds the watermark in it at alpha =
    # 1e-4 (ten times stricter than the trace's; its null table's smallest p-value is 1e-5). The
    # sampling is seeded (one request alone in its batch) and so is its salt (the seed's); the
    # callers' message IDs come from the seeded allocation (``seeded_message_ids``): the same
    # answers, the same verdicts, on every run.
    for seed in range(7, 15):
        request = GenerationRequest((ChatTurn("user", ESSAY),), max_tokens=tokens, temperature=0.8, seed=seed)
        choice = (await backend.generate(request, stamp)).choices[0]
        if choice.completion_tokens < 0.6 * tokens:
            continue
        ids = backend.tokenizer.encode(choice.text, add_special_tokens=False)
        if detect(decode(ids, handle.key), alpha=1e-4).is_watermarked:
            return str(choice.text)
    raise AssertionError("no seed gave an answer whose watermark the library detects")


async def test_trace_needs_the_auditor_or_admin_role(
    client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any
) -> None:
    _, user_key = await make_user("user")
    before = await _trace_count(db_session)
    denied = await client.post("/trace", json={"text": "some text here"}, headers=_auth(user_key))
    assert denied.status_code == 403
    assert denied.json()["error"]["type"] == "permission_error"
    anonymous = await client.post("/trace", json={"text": "some text here"})
    assert anonymous.status_code == 401
    assert await _trace_count(db_session) == before


async def test_bad_trace_requests_write_nothing(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, ready: None
) -> None:
    _, key = await make_user("auditor")
    limit = app.state.resources.settings.max_trace_chars
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"text": "a" * (limit + 1)}, 413, "text"),
        ({"text": ""}, 422, "text"),
        ({}, 422, "text"),
        ({"text": "hello there", "model": "gpt-4o"}, 404, "model"),
        ({"text": "hello there", "include_tokens": "sometimes"}, 422, "include_tokens"),
        ({"text": "hello there", "alpha": 0.5}, 400, "alpha"),  # not a /trace field: refused, not dropped
        ({"text": "hello there", "identity_level": 0}, 422, "identity_level"),
        ({"text": "hello there", "identity_level": 1.5}, 422, "identity_level"),
        ({"text": "hello there", "identity_level": 0.01, "decoder": "counting"}, 400, "identity_level"),
    ]
    before = await _trace_count(db_session)
    for body, status, param in cases:
        response = await client.post("/trace", json=body, headers=_auth(key))
        assert response.status_code == status, (body.keys(), response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
    assert await _trace_count(db_session) == before


async def test_short_text_is_reported_unwatermarked_and_recorded(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, ready: None
) -> None:
    auditor, key = await make_user("auditor")
    before = await _trace_count(db_session)
    response = await client.post("/trace", json={"text": "Hi", "include_tokens": True}, headers=_auth(key))
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["watermarked"] is False
    assert report["scored_tokens"] == 0
    assert report["attribution"] is None
    assert report["p_value"] == 1.0
    assert len(report["blocks"]) == app.state.resources.keyring.params.num_blocks
    assert report["tokens"] and all(t["block"] is None for t in report["tokens"])
    assert await _trace_count(db_session) == before + 1
    row = (await db_session.scalars(select(Trace).order_by(Trace.id.desc()).limit(1))).one()
    assert row.requester_id == auditor["user_id"]
    assert row.verdict == "not_watermarked"
    assert row.attributed_user_id is None


async def test_generated_text_is_attributed_even_after_the_user_is_deleted(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, admin_key: str, ready: None
) -> None:
    target, _ = await make_user("user", "target-user")
    other, _ = await make_user("user", "other-user")
    _, auditor_key = await make_user("auditor")
    text = await _watermarked_text(app, target["message_id"])
    before = await _trace_count(db_session)
    metric = app.state.resources.metrics.trace_verdicts.labels(verdict="watermarked", attributed="yes")
    counted = metric._value.get()

    response = await client.post(
        "/trace", json={"text": text, "model": MODEL, "include_tokens": True}, headers=_auth(auditor_key)
    )
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["watermarked"] is True
    assert report["p_value"] < 1e-3
    assert report["key_version"] == app.state.resources.keyring.active().name
    # how many tokens are scored depends on the answer (its length, repeated contexts), which
    # depends on the random message ID; the count must be positive and leave out the first two
    text_tokens = len(app.state.resources.backend.tokenizer.encode(text, add_special_tokens=False))
    assert 0 < report["scored_tokens"] <= text_tokens - 2
    attribution = report["attribution"]
    assert attribution is not None
    assert attribution["user_id"] == target["user_id"]
    assert attribution["name"] == "target-user"
    assert attribution["p_value"] < 1e-3
    assert 0.0 < attribution["confidence"] <= 1.0
    candidates = report["candidates"]
    assert 1 <= len(candidates) <= 5
    assert candidates[0]["user_id"] == target["user_id"]
    assert other["user_id"] not in [c["user_id"] for c in candidates[:1]]
    assert [c["score"] for c in candidates] == sorted((c["score"] for c in candidates), reverse=True)
    bits = app.state.resources.keyring.params.bits
    assert len(report["decoded_message"]) == bits
    assert candidates[0]["hamming"] == sum(
        a != b for a, b in zip(report["decoded_message"], target["message_id"], strict=True)
    )
    blocks = report["blocks"]
    assert [b["index"] for b in blocks] == list(range(app.state.resources.keyring.params.num_blocks))
    assert sum(sum(b["counts"]) for b in blocks) >= report["scored_tokens"]
    tokens = report["tokens"]
    tokenizer = app.state.resources.backend.tokenizer
    assert [t["id"] for t in tokens] == tokenizer.encode(text, add_special_tokens=False)
    assert tokens[0]["block"] is None and tokens[1]["block"] is None
    scored = [t for t in tokens if t["block"] is not None]
    assert len(scored) == report["scored_tokens"]
    assert all(
        0 <= t["block"] < len(blocks) and len(t["shards"]) == app.state.resources.keyring.params.num_keys
        for t in scored
    )
    assert "".join(t["text"] for t in tokens) == text

    row = (await db_session.scalars(select(Trace).order_by(Trace.id.desc()).limit(1))).one()
    assert row.verdict == "watermarked"
    assert row.attributed_user_id == target["user_id"]
    assert row.key_version_id == app.state.resources.keyring.active().id
    assert metric._value.get() == counted + 1

    deleted = await client.delete(f"/admin/users/{target['user_id']}", headers=_auth(admin_key))
    assert deleted.status_code == 200, deleted.text
    again = await client.post("/trace", json={"text": text}, headers=_auth(auditor_key))
    assert again.status_code == 200
    assert again.json()["attribution"]["user_id"] == target["user_id"]
    assert "tokens" not in again.json() or again.json()["tokens"] is None
    assert await _trace_count(db_session) == before + 2


async def test_every_usable_key_version_is_tried(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    handles = app.state.resources.keyring.usable()
    assert len(handles) >= 2, "the test settings configure two key versions"
    other_version = next(h for h in handles if h.id != app.state.resources.keyring.active().id)
    target, _ = await make_user("user")
    _, auditor_key = await make_user("auditor")
    text = await _watermarked_text(app, target["message_id"], key_version=other_version.name)
    response = await client.post("/trace", json={"text": text}, headers=_auth(auditor_key))
    report = response.json()
    assert report["key_version"] == other_version.name
    assert report["watermarked"] is True
    assert report["attribution"]["user_id"] == target["user_id"]


async def test_registry_cache_reloads_only_when_users_change(
    app: Any, db_session: AsyncSession, make_user: Any
) -> None:
    params = app.state.resources.keyring.params
    cache = RegistryCache(app.state.resources.sessionmaker, check_interval=0.0)
    first = await cache.snapshot(params, db_session)
    assert cache.reloads == 1
    assert await cache.snapshot(params, db_session) is first
    assert cache.reloads == 1
    created, _ = await make_user("user")
    refreshed = await cache.snapshot(params, db_session)
    assert cache.reloads == 2
    assert len(refreshed) == len(first) + 1
    assert created["user_id"] in refreshed.users

    throttled = RegistryCache(app.state.resources.sessionmaker, check_interval=3600.0)
    snapshot = await throttled.snapshot(params, db_session)
    await make_user("user")
    assert await throttled.snapshot(params, db_session) is snapshot  # within the interval: no query at all
    throttled.invalidate()
    assert len(await throttled.snapshot(params, db_session)) == len(snapshot) + 1


async def test_a_large_registry_reads_only_what_changed(
    app: Any, db_session: AsyncSession, make_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``INCREMENTAL_FROM`` IDs (here: from the first), a change is read into the snapshot (new
    IDs appended, changed users updated) without reloading the registry; a newest value that went
    back (rows rolled back) reloads it."""
    monkeypatch.setattr(registry_cache, "INCREMENTAL_FROM", 0)
    params = app.state.resources.keyring.params
    cache = RegistryCache(app.state.resources.sessionmaker, check_interval=0.0)
    first = await cache.snapshot(params, db_session)
    assert (cache.reloads, cache.refreshes) == (1, 0)
    assert await cache.snapshot(params, db_session) is first  # nothing changed: no read
    created, _ = await make_user("user")
    grown = await cache.snapshot(params, db_session)
    assert (cache.reloads, cache.refreshes) == (1, 1)
    assert len(grown) == len(first) + 1 and grown.candidates.ids[-1] == created["user_id"]
    assert grown.candidates.bits_of(len(grown) - 1) == created["message_id"]
    assert grown.users[created["user_id"]].status == "active"
    # a status change: the user keeps their place, the snapshot learns the status
    await db_session.execute(
        update(User).where(User.id == created["user_id"]).values(status="disabled", updated_at=datetime.now(UTC))
    )
    changed = await cache.snapshot(params, db_session)
    assert (cache.reloads, cache.refreshes) == (1, 2) and len(changed) == len(grown)
    assert changed.users[created["user_id"]].status == "disabled"
    # the same answer as a whole reload
    reloaded = await RegistryCache(app.state.resources.sessionmaker).snapshot(params, db_session)
    assert list(reloaded.candidates.ids) == list(changed.candidates.ids)
    assert (reloaded.candidates.blocks == changed.candidates.blocks).all()
    assert reloaded.users == changed.users
    # rows that disappear (a rolled-back transaction's): the newest user id goes back, the registry reloads
    savepoint = await db_session.begin_nested()
    now = datetime.now(UTC)
    db_session.add(
        User(name="rolled-back", role="user", status="active", message_id="1" * 32, created_at=now, updated_at=now)
    )
    await db_session.flush()
    await cache.snapshot(params, db_session)
    assert cache.reloads == 1
    await savepoint.rollback()
    again = await cache.snapshot(params, db_session)
    assert cache.reloads == 2 and len(again) == len(changed)


async def test_trace_tokenization_matches_the_tokenizer(app: Any, ready: None) -> None:
    """/trace reads token ids through the fast tokenizer's backend: exactly tokenizer.encode's ids."""
    from service.trace.analysis import tokenize

    tokenizer = app.state.resources.backend.tokenizer
    texts = [
        ESSAY,
        "  leading spaces, tabs\tand\nnew lines  ",
        "Ünïcödé — “quotes”, emoji 🚢⚓ and CJK 帆船",
        f"special tokens in the text: {tokenizer.eos_token} <|im_start|>user",
        "",
    ]
    for text in texts:
        assert tokenize(tokenizer, text) == list(tokenizer.encode(text, add_special_tokens=False))


async def test_trace_tokenization_ignores_a_truncation_in_the_tokenizer_file(app: Any, ready: None) -> None:
    """A checkpoint whose tokenizer file configures truncation still has every token read."""
    import copy

    from service.trace.analysis import tokenize

    tokenizer = copy.deepcopy(app.state.resources.backend.tokenizer)
    tokenizer.backend_tokenizer.enable_truncation(max_length=8)
    expected = list(app.state.resources.backend.tokenizer.encode(ESSAY, add_special_tokens=False))
    assert len(expected) > 8
    assert tokenize(tokenizer, ESSAY) == expected


async def test_null_distributions_are_prepared_at_start_up(settings: Any, migrated_database: str) -> None:
    """With XMARK_TRACE_WARM_ROW_TOKENS=n the lifespan simulates rows of 1..n tokens in the
    background, so the first traces find them cached; larger rows are left for first use."""
    import asyncio

    from service.app import create_app
    from xmark_core.null import row_null

    warm = 3
    application = create_app(settings.model_copy(update={"trace_warm_row_tokens": warm}))
    row_null.cache_clear()
    async with application.router.lifespan_context(application):
        warmer = application.state.resources.trace_null_warmer
        assert warmer is not None
        # 5x margin and more: the three row sizes were ready 0.9 s after the lifespan started here
        await asyncio.wait_for(asyncio.shield(warmer), timeout=120)
        params = application.state.resources.keyring.active().key.params
        upper = params.scheme == "mpac"
        misses = row_null.cache_info().misses
        for n in range(1, warm + 1):
            row_null(n, params.num_shards, params.num_keys, True, upper)
        assert row_null.cache_info().misses == misses, "a prepared row size was simulated again"
        row_null(warm + 1, params.num_shards, params.num_keys, True, upper)
        assert row_null.cache_info().misses == misses + 1


async def test_token_pieces_join_to_the_text_when_a_character_spans_tokens(app: Any, ready: None) -> None:
    """A byte-level token can end inside a multi-byte character: decoded alone it is U+FFFD. The
    report gives that character to the token that completes it, so the pieces join to the text."""
    from service.trace.analysis import _pieces, tokenize

    tokenizer = app.state.resources.backend.tokenizer
    text = "The sail was called the lÃ¶f, 日本語 and émigré."
    ids = tokenize(tokenizer, text)
    alone = [tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in ids]
    assert any("\ufffd" in piece for piece in alone)  # the case this is about occurs in this text
    pieces = _pieces(tokenizer, ids)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


class LoopProbe:
    """Measures how late the event loop wakes a task that sleeps 10 ms at a time (its lag)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = False

    async def run(self) -> None:
        import asyncio
        import time

        while not self._stop:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            self.lags.append(time.perf_counter() - started - 0.01)

    def stop(self) -> None:
        self._stop = True


def _cjk_text(chars: int) -> str:
    # common CJK ideographs in an order no merge rule joins: about 2.6 tokens each
    return "".join(chr(0x4E00 + (i * 7919) % 0x5000) for i in range(chars))


@pytest.mark.parametrize(("chars", "decoder"), [(8000, "counting"), (500, "likelihood")])
async def test_a_text_long_in_tokens_is_read_off_the_event_loop(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None, chars: int, decoder: str
) -> None:
    """8,000 CJK characters are ~21k tokens: their analysis (and a likelihood decoder's forward
    pass) must not hold the event loop, or every stream of the process stalls meanwhile."""
    import asyncio
    import time

    from service.trace.analysis import tokenize
    from service.trace.service import INLINE_ANALYSIS_TOKENS

    _, key = await make_user("auditor")
    text = _cjk_text(chars)
    tokens = len(tokenize(app.state.resources.backend.tokenizer, text))
    limit = app.state.resources.settings.trace_likelihood_max_tokens
    assert tokens > max(4 * INLINE_ANALYSIS_TOKENS, chars)
    assert decoder == "counting" or tokens <= limit
    probe = LoopProbe()
    task = asyncio.create_task(probe.run())
    started = time.perf_counter()
    response = await client.post("/trace", json={"text": text, "decoder": decoder}, headers=_auth(key))
    took = time.perf_counter() - started
    probe.stop()
    await task
    assert response.status_code == 200, response.text
    assert response.json()["decoder"] == decoder
    print(f"{decoder}: {tokens} tokens in {took:.2f} s, loop lag max {max(probe.lags) * 1000:.0f} ms")
    # the trace takes its time, the loop keeps answering: a ratio against the trace's own duration
    # measured above, so a loaded machine, which slows both, moves the bound with it. An analysis
    # (or forward pass) on the loop would stall it for most of that duration; here the largest lag
    # was 1.5% of it (38 ms of 2.5 s, counting) and 0.2% (19 ms of 9.8 s, likelihood), and the bound
    # is a tenth (0.25 s for the counting decoder here)
    assert max(probe.lags) < took / 10, (max(probe.lags), took)
