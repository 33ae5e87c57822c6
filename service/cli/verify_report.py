"""``xmark verify-report``: check a signed trace report (GET /trace/{report_id}) offline.

The signature is checked with the gateway's public key (given, or read from the gateway's
``/.well-known/xmark-report-key``). With the text, its SHA-256 is compared with the report's and
the trace is run again from the configuration (``xmark trace``: the counting decoder) to see
whether the verdict and the attributed user agree.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.exceptions import ServiceError
from service.services.reports import (
    ReportVerificationError,
    decode_public_key,
    key_id_of,
    text_sha256,
    verify_report,
)

KEY_PATH = "/.well-known/xmark-report-key"
# exit statuses: 0 valid (and, with a text, the re-run agrees), 1 invalid or unreadable,
# 2 valid but the offline re-run disagrees with the report's counting verdict
EXIT_DISAGREES = 2


class VerifyError(ServiceError):
    """The report cannot be accepted; the message says why (exit status 1)."""


def fetch_public_key(server: str, *, timeout_s: float = 10.0) -> bytes:
    """The raw public key a gateway serves, checked against the key id it states."""
    url = server.rstrip("/") + KEY_PATH
    if not url.startswith(("http://", "https://")):
        raise VerifyError("--server must be an http:// or https:// URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # the scheme is checked above
            body = json.loads(response.read().decode("utf-8"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise VerifyError(f"cannot read the public key from {url}: {exc}") from None
    if not isinstance(body, dict) or body.get("alg") != "Ed25519" or not isinstance(body.get("public_key"), str):
        raise VerifyError(f"{url} does not serve an Ed25519 report key")
    raw = decode_public_key(body["public_key"])
    if body.get("key_id") != key_id_of(raw):
        raise VerifyError(f"{url} serves a key whose key_id does not match it")
    return raw


def _read(path: str, what: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise VerifyError(f"cannot read the {what} {path}: {exc}") from None


def _rerun_agrees(report: dict[str, Any], rerun: dict[str, Any]) -> tuple[bool, list[str]]:
    verdict = "watermarked" if rerun.get("watermarked") else "not_watermarked"
    attribution = rerun.get("attribution") or {}
    attributed = attribution.get("user_id")
    lines = [
        f"offline re-run (counting decoder): verdict {verdict}, attributed user {attributed}",
        f"report:                            verdict {report.get('verdict')}, "
        f"attributed user {report.get('attributed_user_id')} (decided by {report.get('decoder')})",
    ]
    agrees = verdict == report.get("verdict") and attributed == report.get("attributed_user_id")
    return agrees, lines


def verify_report_file(
    path: str,
    *,
    public_key_b64: str | None,
    server: str | None,
    text_path: str | None,
    rerun: Callable[[str], dict[str, Any]] | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Check the report in ``path``; the exit status (see the module's constants)."""
    if (public_key_b64 is None) == (server is None):
        raise VerifyError("give exactly one of --public-key or --server")
    try:
        document = json.loads(_read(path, "report"))
    except ValueError:
        raise VerifyError(f"{path} is not JSON") from None
    if not isinstance(document, dict):
        raise VerifyError(f"{path} is not a trace report document")
    try:
        public_key = decode_public_key(public_key_b64) if public_key_b64 is not None else None
        if public_key is None:
            assert server is not None
            public_key = fetch_public_key(server)
        report = verify_report(document, public_key)
    except ReportVerificationError as exc:
        raise VerifyError(f"INVALID: {exc}") from None
    out(f"signature valid: report {report.get('report_id')} signed by key {key_id_of(public_key)}")
    out(
        f"verdict {report.get('verdict')}, attributed user {report.get('attributed_user_id')}, "
        f"key version {report.get('key_version')}, created {report.get('created_at')}"
    )
    if text_path is None:
        return 0
    text = _read(text_path, "text")
    if text_sha256(text) != report.get("text_sha256"):
        raise VerifyError("INVALID: the text's SHA-256 differs from the report's (not the text that was traced)")
    out("text matches the report's SHA-256")
    if rerun is None:
        from service.cli.offline_trace import offline_trace
        from service.config import Settings

        def rerun(value: str) -> dict[str, Any]:
            return offline_trace(Settings(), value)

    agrees, lines = _rerun_agrees(report, rerun(text))
    for line in lines:
        out(line)
    if agrees:
        out("the offline re-run agrees with the report")
        return 0
    if report.get("decoder") != "counting":
        out(
            "the offline re-run differs; the report was decided by the likelihood decoder, "
            "which reads the model's scores (the offline re-run counts only)"
        )
        return 0
    out("the offline re-run DISAGREES with the report")
    return EXIT_DISAGREES
