"""/trace with include_tokens: every token's evidence for the named user, by both decoders."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.service.trace.test_trace import _auth, _watermarked_text

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry")]


async def test_counting_evidence_follows_the_named_users_blocks(
    app: Any, client: httpx.AsyncClient, make_user: Any
) -> None:
    assert await app.state.resources.backend.wait_ready(180)
    author, _ = await make_user("user")
    _, auditor = await make_user("auditor")
    text = await _watermarked_text(app, author["message_id"])
    response = await client.post(
        "/trace", json={"text": text, "decoder": "counting", "include_tokens": True}, headers=_auth(auditor)
    )
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["attribution"]["user_id"] == author["user_id"]
    d = app.state.resources.keyring.params.block_bits
    bits = author["message_id"]
    values = [int(bits[i : i + d], 2) for i in range(0, len(bits), d)]
    kinds = {"supports": 0, "contradicts": 0}
    for token in report["tokens"]:
        if token["block"] is None:
            assert token["evidence"] is None
            continue
        boosted = all(shard != values[token["block"]] for shard in token["shards"])
        assert token["evidence"] == ("supports" if boosted else "contradicts")
        kinds[token["evidence"]] += 1
    assert kinds["supports"] + kinds["contradicts"] == report["scored_tokens"]
    assert kinds["supports"] > kinds["contradicts"]  # unwatermarked text: about a third supports (k = 4, d = 2)


async def test_likelihood_evidence_is_the_sign_of_each_tokens_llr(
    app: Any, client: httpx.AsyncClient, make_user: Any
) -> None:
    assert await app.state.resources.backend.wait_ready(180)
    author, _ = await make_user("user")
    _, auditor = await make_user("auditor")
    text = await _watermarked_text(app, author["message_id"], tokens=200)
    response = await client.post(
        "/trace", json={"text": text, "decoder": "likelihood", "include_tokens": True}, headers=_auth(auditor)
    )
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["decoder"] == "likelihood"
    assert report["candidates"][0]["user_id"] == author["user_id"]
    signs = []
    for token in report["tokens"]:
        llr = token["llr"]
        expected = None if llr is None or llr == 0 else ("supports" if llr > 0 else "contradicts")
        assert token["evidence"] == expected
        signs.append(expected)
    assert signs.count("supports") > signs.count("contradicts") > 0
