"""The signed report of a trace: built and signed when /trace decides, stored with the trace row,
and read back as the document GET /trace/{report_id} serves.

The report is signed as built here and stored as the exact canonical JSON that was signed
(``traces.report_payload``), so the document served later carries the same bytes whatever the
database does to timestamps or floats, and renaming a user afterwards does not change it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from service.services.reports import ReportSigner, canonical_json, iso_utc, new_report_id, text_sha256
from service.trace.schemas import ReportSignature, SignedReport, TraceReport, TraceReportDocument
from service.vocabulary import TraceDecoder, TraceVerdict

if TYPE_CHECKING:
    from service.keyring import KeyVersionHandle
    from service.models import Trace


@functools.cache
def gateway_version() -> str:
    """The installed gateway's version (part of every report: the code that decided)."""
    try:
        return importlib.metadata.version("xmark-gateway")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class SignedReportInput:
    """What a trace decided and under which settings (the report's fields come from these)."""

    created_at: datetime
    requester_id: int
    text: str
    report: TraceReport
    verdict: TraceVerdict
    handle: KeyVersionHandle | None
    requested_decoder: TraceDecoder
    alpha: float
    top_k: int | None


@dataclass(frozen=True)
class SignedReportRecord:
    report_id: str
    created_at: datetime
    # the report's columns of the traces row
    columns: dict[str, Any]


def build_signed_report(signer: ReportSigner, given: SignedReportInput) -> SignedReportRecord:
    """The report of a trace, signed; numbers are cast to the JSON types the schema serves them as,
    so the document served later re-serializes to exactly the signed bytes."""
    report = given.report
    handle = given.handle
    params: dict[str, Any] | None = None
    if handle is not None:
        p = handle.key.params
        params = {
            "b": int(p.bits),
            "d": int(p.block_bits),
            "k": int(p.num_keys),
            "delta": float(p.delta),
            "scheme": str(p.scheme),
        }
        if p.gated:  # only for key versions with the entropy rule: other reports never held it
            params["min_entropy"] = float(p.min_entropy)
        if p.salts > 1:  # only for salted key versions: other reports never held it
            params["salts"] = int(p.salts)
    settings = {
        "decoder": str(given.requested_decoder),
        "temperature": None if report.temperature is None else float(report.temperature),
        "edit_rate": None if report.edit_rate is None else float(report.edit_rate),
        "top_k": given.top_k,
        "alpha": float(given.alpha),
        "test": report.test,
    }
    if report.identity_level is not None:  # only where asked for: older reports never held it
        settings["identity_level"] = float(report.identity_level)
    attribution = report.attribution
    payload: dict[str, Any] = {
        "report_id": new_report_id(),
        "created_at": iso_utc(given.created_at),
        "requester_id": int(given.requester_id),
        "text_sha256": text_sha256(given.text),
        "scored_tokens": int(report.scored_tokens),
        "key_version": None if handle is None else handle.name,
        "key_version_fingerprint": None if handle is None else handle.key.fingerprint,
        "params": params,
        "decoder": str(report.decoder),
        "decoder_settings": settings,
        "gateway_version": gateway_version(),
        "verdict": str(given.verdict),
        "p_value": float(report.p_value),
        "statistic": float(report.statistic),
        "attributed_user_id": None if attribution is None else int(attribution.user_id),
        "attributed_user_name": None if attribution is None else attribution.name,
    }
    if attribution is not None and attribution.end_user is not None:  # only then: older reports never held it
        payload["attributed_end_user"] = {
            "id": int(attribution.end_user.id),
            "identifier": attribution.end_user.identifier,
        }
    if report.identity_level is not None:
        payload["identity_p_value"] = None if report.identity_p_value is None else float(report.identity_p_value)
    payload["named_by"] = report.named_by
    payload["corroboration"] = None if report.corroboration is None else report.corroboration.model_dump(mode="json")
    payload["model"] = report.model
    signature = signer.sign(payload)
    columns = {
        "report_id": payload["report_id"],
        "text_sha256": payload["text_sha256"],
        "key_version_fingerprint": payload["key_version_fingerprint"],
        "params": None if params is None else json.dumps(params, sort_keys=True),
        "decoder_settings": json.dumps(settings, sort_keys=True),
        "gateway_version": payload["gateway_version"],
        "report_payload": canonical_json(payload).decode("utf-8"),
        "signature": signature,
        "signing_key_id": signer.key_id,
    }
    return SignedReportRecord(payload["report_id"], given.created_at, columns)


def report_document(
    trace: Trace, *, key_version: str | None, key_fingerprint: str | None, attributed_name: str | None
) -> TraceReportDocument:
    """The served document of a trace row: the stored signed payload, or (traces recorded before
    reports were signed) the row's fields without a signature."""
    if trace.report_payload is not None and trace.signature is not None and trace.signing_key_id is not None:
        report = SignedReport.model_validate(json.loads(trace.report_payload))
        signature = ReportSignature(key_id=trace.signing_key_id, value=trace.signature)
        return TraceReportDocument(report=report, signature=signature)
    report = SignedReport(
        report_id=trace.report_id,
        created_at=iso_utc(trace.created_at),
        requester_id=trace.requester_id,
        text_sha256=trace.text_sha256,
        scored_tokens=trace.scored_tokens,
        key_version=key_version,
        key_version_fingerprint=trace.key_version_fingerprint or key_fingerprint,
        params=None,
        decoder=TraceDecoder(trace.decoder),
        decoder_settings=None,
        gateway_version=trace.gateway_version,
        verdict=TraceVerdict(trace.verdict),
        p_value=trace.p_value,
        statistic=trace.statistic,
        attributed_user_id=trace.attributed_user_id,
        attributed_user_name=attributed_name,
    )
    return TraceReportDocument(report=report, signature=None)
