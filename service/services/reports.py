"""Signed trace reports: the canonical payload of a /trace verdict and its Ed25519 signature.

A report states that this gateway issued a verdict on a text with a given SHA-256 under a given
key version and parameters. Anyone holding the gateway's public key (``GET
/.well-known/xmark-report-key``) can check it offline: :func:`verify_report` needs nothing but this
module and ``cryptography`` (the ``xmark verify-report`` command imports it without the app).

The signed bytes are the canonical JSON of the report's fields under the JSON Canonicalization
Scheme (RFC 8785, the ``rfc8785`` package): keys sorted, no spaces, UTF-8, numbers written as
JavaScript writes them, no NaN or infinity. So a report re-serialized by any JSON tool (a browser
saving it, a pretty-printer) still verifies as long as no value changed. The signing key is derived with HKDF
from a server secret under a label of its own (``XMARK_REPORT_SIGNING_KEY``, or the API-key pepper
when that is not set), so it is never stored separately and is independent of the secret's other
uses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from service.exceptions import ServiceError

ALG = "Ed25519"
# HKDF label of the signing key: a secret used for anything else yields an unrelated key here
SIGNING_KEY_LABEL = b"xmark-gateway trace report signing key v1"
REPORT_ID_PREFIX = "trc_"

# the signed fields of a report, in the order the API documents them
REPORT_FIELDS = (
    "report_id",
    "created_at",
    "requester_id",
    "text_sha256",
    "scored_tokens",
    "key_version",
    "key_version_fingerprint",
    "params",
    "decoder",
    "decoder_settings",
    "gateway_version",
    "verdict",
    "p_value",
    "statistic",
    "attributed_user_id",
    "attributed_user_name",
)


class ReportVerificationError(ServiceError):
    """A report or its signature cannot be checked, or does not verify; the message says why."""


def new_report_id() -> str:
    """``trc_`` and 24 URL-safe random characters (144 bits): unguessable, unique in practice."""
    return REPORT_ID_PREFIX + secrets.token_urlsafe(18)


def text_sha256(text: str) -> str:
    """Hex SHA-256 of the text's UTF-8 bytes (what a report binds instead of the text)."""
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def canonical_json(payload: Mapping[str, Any]) -> bytes:
    """The bytes that are signed: the RFC 8785 canonical form (ValueError on NaN, infinity or a
    value JSON cannot hold)."""
    return rfc8785.dumps(dict(payload))


def key_id_of(public_key: bytes) -> str:
    """A short fingerprint of a raw 32-byte public key (16 hex characters of its SHA-256)."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def decode_public_key(value: str) -> bytes:
    """The raw 32 bytes of a base64 public key (ReportVerificationError otherwise)."""
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ReportVerificationError("the public key is not valid base64") from None
    if len(raw) != 32:
        raise ReportVerificationError("the public key must be 32 bytes (a raw Ed25519 key)")
    return raw


@dataclass(frozen=True)
class ReportSigner:
    """The gateway's report signing key; ``repr`` never shows it."""

    _private: Ed25519PrivateKey = field(repr=False)
    public_key: bytes
    key_id: str

    @classmethod
    def from_secret(cls, secret: bytes) -> ReportSigner:
        """The signing key derived from a server secret (HKDF-SHA256 under :data:`SIGNING_KEY_LABEL`)."""
        seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SIGNING_KEY_LABEL).derive(secret)
        private = Ed25519PrivateKey.from_private_bytes(seed)
        public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(private, public, key_id_of(public))

    @property
    def public_key_b64(self) -> str:
        return base64.b64encode(self.public_key).decode("ascii")

    def sign(self, payload: Mapping[str, Any]) -> str:
        """The base64 signature of the canonical JSON of ``payload``."""
        return base64.b64encode(self._private.sign(canonical_json(payload))).decode("ascii")


def verify_report(document: Mapping[str, Any], public_key: bytes) -> dict[str, Any]:
    """Check a ``GET /trace/{report_id}`` document against a raw public key; its report if valid.

    Raises :class:`ReportVerificationError` saying what is wrong: a malformed document, a report
    signed by another key (``key_id``), or a signature that does not match the report's bytes.
    """
    report = document.get("report")
    signature = document.get("signature")
    if not isinstance(report, dict):
        raise ReportVerificationError("the document has no 'report' object")
    if not isinstance(signature, dict):
        raise ReportVerificationError("the report carries no signature (recorded before reports were signed)")
    if signature.get("alg") != ALG:
        raise ReportVerificationError(f"unsupported signature algorithm {signature.get('alg')!r} (expected {ALG})")
    expected_id = key_id_of(public_key)
    if signature.get("key_id") != expected_id:
        raise ReportVerificationError(
            f"the report was signed by key {signature.get('key_id')!r}, not by the given public key ({expected_id})"
        )
    value = signature.get("value")
    try:
        raw_signature = base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ReportVerificationError("the signature is not valid base64") from None
    try:
        payload = canonical_json(report)
    except (TypeError, ValueError):
        raise ReportVerificationError("the report is not canonical JSON (non-finite numbers?)") from None
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(raw_signature, payload)
    except InvalidSignature:
        raise ReportVerificationError("the signature does not match the report: it was changed or forged") from None
    return dict(report)


def iso_utc(moment: datetime) -> str:
    """``2026-11-24T01:02:03.456789Z``: the report's timestamp format (always microseconds)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
