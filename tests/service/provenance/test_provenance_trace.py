"""/trace with the generation log as a second witness (real model, PostgreSQL): a served answer is
named and corroborated; a forged watermark (made with the library and the server's secret, never
served) is named by the watermark and reported as found in no generation; provenance off and
purged sketches say so."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Generation, utcnow
from service.provenance.search import NOT_FOUND_NOTE, RIVAL_NOTE
from service.repositories.provenance import ProvenanceRepository
from tests.service.trace.test_trace import ESSAY, _auth, _watermarked_text

# the answers and their verdicts depend on the users' message IDs: drawn from a seeded generator
# (tests/service/conftest.py), with seeded sampling, they give one outcome on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]


async def _served(client: httpx.AsyncClient, db_session: AsyncSession, key: str) -> tuple[str, str]:
    """An answer served through the chat API (so logged), long enough to be named; its text and id."""
    for seed in range(7, 12):
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": ESSAY}],
            "max_tokens": 300,
            "temperature": 0.8,
            "seed": seed,
        }
        response = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
        assert response.status_code == 200, response.text
        data = response.json()
        if data["usage"]["completion_tokens"] >= 180:
            break
    for _ in range(100):  # the record is written as the response ends
        if await db_session.scalar(select(Generation.id).where(Generation.request_id == data["id"])):
            break
        await asyncio.sleep(0.05)
    return data["choices"][0]["message"]["content"], data["id"]


async def _trace(client: httpx.AsyncClient, key: str, text: str) -> dict[str, Any]:
    response = await client.post("/trace", json={"text": text}, headers=_auth(key))
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_served_answer_is_named_and_corroborated(
    client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, ready: None
) -> None:
    author, key = await make_user("user", "served-author")
    _, auditor = await make_user("auditor")
    text, request_id = await _served(client, db_session, key)
    report = await _trace(client, auditor, text)
    assert report["attribution"]["user_id"] == author["user_id"]
    assert report["named_by"] == "watermark"
    corroboration = report["corroboration"]
    assert corroboration["status"] == "corroborated"
    assert corroboration["note"] is None
    top = corroboration["matches"][0]
    assert top["user_id"] == author["user_id"] and top["request_id"] == request_id and top["similarity"] == 1.0
    assert set(top) == {"user_id", "request_id", "created_at", "similarity"}  # no text, no hash
    document = (await client.get(f"/trace/{report['report_id']}", headers=_auth(auditor))).json()
    assert document["report"]["named_by"] == "watermark"
    assert document["report"]["corroboration"] == corroboration
    assert document["signature"] is not None


async def test_a_forged_watermark_is_named_but_found_in_no_generation(
    app: Any, client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    victim, _ = await make_user("user", "forgery-victim")
    _, auditor = await make_user("auditor")
    # made with the library and the server's own key, outside the gateway: never logged
    forged = await _watermarked_text(app, victim["message_id"])
    report = await _trace(client, auditor, forged)
    assert report["attribution"]["user_id"] == victim["user_id"]
    assert report["named_by"] == "watermark"
    assert report["corroboration"]["status"] == "not_found"
    matches = report["corroboration"]["matches"]
    assert all(m["user_id"] != victim["user_id"] for m in matches)
    # other tests' completions answer prompts like this one: the note names the better explanation
    # when one of them matches the text as much as a match must
    rival = any(m["similarity"] >= app.state.resources.settings.provenance_match_similarity for m in matches)
    assert report["corroboration"]["note"] == (RIVAL_NOTE if rival else NOT_FOUND_NOTE)


async def test_purged_sketches_and_provenance_off_are_reported(
    app: Any, client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, ready: None, monkeypatch: Any
) -> None:
    author, key = await make_user("user", "purged-author")
    _, auditor = await make_user("auditor")
    text, _ = await _served(client, db_session, key)
    repo = ProvenanceRepository(db_session)
    while await repo.purge_before(utcnow() + timedelta(days=1)):
        pass
    report = await _trace(client, auditor, text)
    assert report["attribution"]["user_id"] == author["user_id"]
    assert report["corroboration"]["status"] == "not_found"

    monkeypatch.setattr(app.state.resources, "sketcher", None)  # XMARK_PROVENANCE=off
    text_off, request_off = await _served(client, db_session, key)
    row = (await db_session.scalars(select(Generation).where(Generation.request_id == request_off))).one()
    assert row.sketch_terms is None and row.sketch_minhash is None
    report = await _trace(client, auditor, text_off)
    assert report["corroboration"] == {"status": "disabled", "matches": [], "note": None}
    assert report["named_by"] == "watermark"
