"""Signed trace reports: POST /trace stores one, GET /trace/{id} serves it, the public key verifies
it; a changed byte or another server's key does not; roles and unknown ids."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from typing import Any

import httpx
import pytest

from service.services.reports import ReportSigner, ReportVerificationError, decode_public_key, verify_report

# no assertion here depends on the verdict (the report is checked against the trace's own answer,
# whatever it says); the auditors' message IDs are seeded anyway (tests/service/conftest.py), so
# the reports are the same on every run
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("seeded_message_ids")]

TEXT = "The harbour was quiet that morning, and the fishing boats waited for the tide to turn. ünïcode ✓"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _public_key(client: httpx.AsyncClient) -> bytes:
    response = await client.get("/.well-known/xmark-report-key")  # no authentication
    assert response.status_code == 200
    body = response.json()
    assert body["alg"] == "Ed25519"
    raw = decode_public_key(body["public_key"])
    assert body["key_id"] == hashlib.sha256(raw).hexdigest()[:16]
    return raw


async def _traced(client: httpx.AsyncClient, key: str, text: str = TEXT) -> tuple[dict[str, Any], dict[str, Any]]:
    traced = await client.post("/trace", json={"text": text, "decoder": "counting"}, headers=_auth(key))
    assert traced.status_code == 200, traced.text
    report_id = traced.json()["report_id"]
    assert report_id.startswith("trc_") and len(report_id) == 28
    fetched = await client.get(f"/trace/{report_id}", headers=_auth(key))
    assert fetched.status_code == 200, fetched.text
    return traced.json(), fetched.json()


async def test_a_trace_report_verifies_with_the_published_key(
    client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    auditor, key = await make_user("auditor")
    trace, document = await _traced(client, key)
    assert document["object"] == "trace.report"
    report = document["report"]
    assert report["report_id"] == trace["report_id"]
    assert report["requester_id"] == auditor["user_id"]
    assert report["text_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    assert report["verdict"] == ("watermarked" if trace["watermarked"] else "not_watermarked")
    assert report["p_value"] == trace["p_value"] and report["scored_tokens"] == trace["scored_tokens"]
    assert report["decoder"] == "counting" and report["decoder_settings"]["decoder"] == "counting"
    assert report["decoder_settings"]["test"] == trace["test"]
    assert report["key_version"] == trace["key_version"]
    assert set(report["params"]) == {"b", "d", "k", "delta", "scheme"}
    assert report["gateway_version"]
    assert verify_report(document, await _public_key(client)) == report


def _as_javascript_saves_it(value: Any) -> Any:
    """``JSON.parse`` then ``JSON.stringify`` in a browser: an integral float loses its ``.0``."""
    if isinstance(value, dict):
        return {k: _as_javascript_saves_it(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_javascript_saves_it(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


async def test_a_report_reserialized_by_another_json_tool_still_verifies(
    client: httpx.AsyncClient, make_user: Any, ready: None
) -> None:
    """The signed bytes are RFC 8785 canonical JSON: pretty-printing, re-ordering and JavaScript's
    number forms change no byte of them."""
    _, key = await make_user("auditor")
    _, document = await _traced(client, key)
    resaved = _as_javascript_saves_it(json.loads(json.dumps(document, indent=2, sort_keys=False)))
    assert resaved["report"]["params"]["delta"] == 2 and isinstance(resaved["report"]["params"]["delta"], int)
    reordered = {"signature": resaved["signature"], "report": dict(reversed(list(resaved["report"].items())))}
    assert verify_report(reordered, await _public_key(client)) == document["report"]


async def test_one_changed_byte_or_another_key_fails(client: httpx.AsyncClient, make_user: Any, ready: None) -> None:
    _, key = await make_user("auditor")
    _, document = await _traced(client, key)
    public_key = await _public_key(client)

    tampered = copy.deepcopy(document)
    digest = tampered["report"]["text_sha256"]
    tampered["report"]["text_sha256"] = ("1" if digest[0] != "1" else "2") + digest[1:]
    with pytest.raises(ReportVerificationError, match="does not match"):
        verify_report(tampered, public_key)
    renamed = copy.deepcopy(document)
    renamed["report"]["requester_id"] += 1
    with pytest.raises(ReportVerificationError, match="does not match"):
        verify_report(renamed, public_key)
    flipped = copy.deepcopy(document)
    raw = bytearray(base64.b64decode(flipped["signature"]["value"]))
    raw[0] ^= 1
    flipped["signature"]["value"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(ReportVerificationError, match="does not match"):
        verify_report(flipped, public_key)

    # another server's key: its own signature of the same report does not verify with ours,
    # and ours does not verify with its key
    other = ReportSigner.from_secret(b"another-gateway-secret-0123456789abcdef")
    forged = copy.deepcopy(document)
    forged["signature"] = {
        "alg": "Ed25519",
        "key_id": document["signature"]["key_id"],
        "value": other.sign(forged["report"]),
    }
    with pytest.raises(ReportVerificationError, match="does not match"):
        verify_report(forged, public_key)
    with pytest.raises(ReportVerificationError, match="signed by key"):
        verify_report(document, other.public_key)


async def test_report_roles_and_unknown_ids(client: httpx.AsyncClient, make_user: Any, ready: None) -> None:
    _, auditor_key = await make_user("auditor")
    _, admin_key = await make_user("admin")
    _, user_key = await make_user("user")
    trace, _ = await _traced(client, auditor_key)
    by_admin = await client.get(f"/trace/{trace['report_id']}", headers=_auth(admin_key))
    assert by_admin.status_code == 200
    denied = await client.get(f"/trace/{trace['report_id']}", headers=_auth(user_key))
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    anonymous = await client.get(f"/trace/{trace['report_id']}")
    assert anonymous.status_code == 401
    missing = await client.get("/trace/trc_doesnotexist000000000000", headers=_auth(auditor_key))
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "report_not_found"
