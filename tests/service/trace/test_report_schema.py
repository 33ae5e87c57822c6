"""The served form of a signed report is the signed form: a report signed before a decoder setting
existed is served without it, so its signature still verifies."""

from __future__ import annotations

from typing import Any

from service.services.reports import ReportSigner, verify_report
from service.trace.schemas import TraceReportDocument


def _payload(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "report_id": "trc_0123456789abcdef01234567",
        "created_at": "2026-01-02T03:04:05.000006+00:00",
        "requester_id": 7,
        "text_sha256": "ab" * 32,
        "scored_tokens": 148,
        "key_version": "v1",
        "key_version_fingerprint": "cd" * 8,
        "params": {"b": 32, "d": 2, "k": 4, "delta": 2.0, "scheme": "xmark"},
        "decoder": "likelihood",
        "decoder_settings": settings,
        "gateway_version": "0.0.0",
        "verdict": "watermarked",
        "p_value": 1.5e-9,
        "statistic": 41.25,
        "attributed_user_id": 12,
        "attributed_user_name": "ada",
    }


def _served(payload: dict[str, Any], signer: ReportSigner) -> dict[str, Any]:
    """What GET /trace/{id} answers for a stored payload (validated, then dumped as JSON)."""
    document = TraceReportDocument.model_validate(
        {"report": payload, "signature": {"key_id": signer.key_id, "value": signer.sign(payload)}}
    )
    served: dict[str, Any] = document.model_dump(mode="json")
    return served


def test_a_report_signed_before_the_edit_rate_existed_is_served_as_signed() -> None:
    signer = ReportSigner.from_secret(b"s" * 32)
    old = _payload({"decoder": "likelihood", "temperature": 0.7, "top_k": 20, "alpha": 0.001, "test": "likelihood"})
    served = _served(old, signer)
    assert "edit_rate" not in served["report"]["decoder_settings"]
    assert served["report"] == old
    assert verify_report(served, signer.public_key) == old


def test_a_report_with_the_edit_rate_serves_it_null_or_not() -> None:
    signer = ReportSigner.from_secret(b"s" * 32)
    for rate in (0.01, None):
        settings = {"decoder": "auto", "temperature": 0.7, "edit_rate": rate, "top_k": 20, "alpha": 0.001, "test": "t"}
        new = _payload(settings)
        served = _served(new, signer)
        assert served["report"]["decoder_settings"]["edit_rate"] == rate
        assert verify_report(served, signer.public_key) == new


def test_the_identity_fields_are_served_exactly_where_they_were_signed() -> None:
    signer = ReportSigner.from_secret(b"s" * 32)
    settings = {"decoder": "auto", "temperature": 0.7, "edit_rate": 0.01, "top_k": 20, "alpha": 0.001, "test": "t"}
    without = _payload(settings)
    served = _served(without, signer)
    assert "identity_p_value" not in served["report"] and "identity_level" not in served["report"]["decoder_settings"]
    assert verify_report(served, signer.public_key) == without
    for p_value in (3.5e-4, None):  # None: the level was in force, the test did not run (no one explained it)
        signed = {**_payload({**settings, "identity_level": 0.01}), "identity_p_value": p_value}
        served = _served(signed, signer)
        assert served["report"]["identity_p_value"] == p_value
        assert served["report"]["decoder_settings"]["identity_level"] == 0.01
        assert verify_report(served, signer.public_key) == signed


def test_the_entropy_rule_is_served_only_in_reports_of_key_versions_with_it() -> None:
    """A key version without the rule signs its params without ``min_entropy`` (as every report
    before the rule existed) and is served so; one with the rule signs and serves the threshold."""
    signer = ReportSigner.from_secret(b"s" * 32)
    settings = {"decoder": "likelihood", "temperature": 0.7, "top_k": 20, "alpha": 0.001, "test": "likelihood"}
    plain = _payload(settings)
    served = _served(plain, signer)
    assert "min_entropy" not in served["report"]["params"]
    assert verify_report(served, signer.public_key) == plain
    ruled = {**plain, "params": {**plain["params"], "min_entropy": 0.69}}
    served = _served(ruled, signer)
    assert served["report"]["params"]["min_entropy"] == 0.69
    assert verify_report(served, signer.public_key) == ruled
    assert "salts" not in _served(plain, signer)["report"]["params"]
    salted = {**plain, "params": {**plain["params"], "scheme": "gumbel", "salts": 16}}
    served = _served(salted, signer)
    assert served["report"]["params"]["salts"] == 16
    assert verify_report(served, signer.public_key) == salted


def test_the_report_schema_lists_its_fields() -> None:
    """The served document's schema (OpenAPI) names every field, not a bare object."""
    schema = TraceReportDocument.model_json_schema(mode="serialization")["$defs"]
    assert {"identity_p_value", "decoder_settings", "attributed_user_id"} <= set(schema["SignedReport"]["properties"])
    assert {"edit_rate", "identity_level", "alpha"} <= set(schema["DecoderSettings"]["properties"])
