"""``xmark verify-report``: a report of a watermarked text verifies, its text matches and the
offline re-run (the real model's tokenizer, the configured keys, the registry) agrees; a changed
byte of the report or of the text, or another server's key, exits non-zero."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from service.cli import main
from service.db import session_scope
from service.models import ApiKey, MessageId, User
from service.repositories.unit import Repositories
from service.services.reports import ReportSigner
from service.services.users import UserService
from tests.service.trace.test_trace import _watermarked_text as watermarked_text


@pytest.fixture
async def committed_users(app: Any, settings: Any, seeded_message_ids: Any) -> AsyncIterator[dict[str, Any]]:
    """A writer and an auditor committed to the test database (the offline re-run opens its own
    connection, so it cannot see the test's rolled-back rows); removed afterwards. Their message
    IDs come from the seeded allocation (``seeded_message_ids``): the writer's watermarked text,
    and so the verdict, is the same on every run."""
    resources = app.state.resources
    engine = create_async_engine(settings.database_url, poolclass=NullPool)
    from sqlalchemy.ext.asyncio import async_sessionmaker

    maker = async_sessionmaker(engine, expire_on_commit=False)
    async with session_scope(maker) as session:
        service = UserService(Repositories(session), resources.keyring.params, resources.api_key_hasher)
        writer = await service.create_user("verify-writer", "user")  # type: ignore[arg-type]
        auditor = await service.create_user("verify-auditor", "auditor")  # type: ignore[arg-type]
    resources.registry_cache.invalidate()
    try:
        yield {"writer": writer, "auditor": auditor}
    finally:
        ids = [writer.id, auditor.id]
        async with session_scope(maker) as session:
            for table in (ApiKey, MessageId):
                await session.execute(delete(table).where(table.user_id.in_(ids)))
            await session.execute(delete(User).where(User.id.in_(ids)))
        await engine.dispose()
        resources.registry_cache.invalidate()


async def _watermarked_text(app: Any, message_id: str) -> str:
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"
    return await watermarked_text(app, message_id)


def _run(*args: Any) -> int:
    return main(["verify-report", *map(str, args)])


@pytest.mark.model
async def test_verify_report_end_to_end(
    committed_users: dict[str, Any],
    client: httpx.AsyncClient,
    app: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    writer, auditor = committed_users["writer"], committed_users["auditor"]
    text = await _watermarked_text(app, writer.message_id)
    headers = {"Authorization": f"Bearer {auditor.api_key}"}
    traced = await client.post("/trace", json={"text": text, "decoder": "counting"}, headers=headers)
    assert traced.status_code == 200, traced.text
    document = (await client.get(f"/trace/{traced.json()['report_id']}", headers=headers)).json()
    assert document["report"]["attributed_user_id"] == writer.id
    assert document["report"]["attributed_user_name"] == "verify-writer"
    public_key = (await client.get("/.well-known/xmark-report-key")).json()["public_key"]

    report_file, text_file = tmp_path / "report.json", tmp_path / "text.txt"
    report_file.write_text(json.dumps(document))
    text_file.write_text(text, encoding="utf-8")
    # the offline re-run reads the gateway's configuration (the test settings) from the environment
    settings = app.state.resources.settings
    monkeypatch.setenv("XMARK_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("XMARK_WATERMARK_SECRETS", settings.watermark_secrets.get_secret_value())
    monkeypatch.setenv("XMARK_API_KEY_PEPPER", settings.api_key_pepper.get_secret_value())
    monkeypatch.setenv("XMARK_MODEL_PATH", str(settings.resolved_model_path()))
    monkeypatch.setenv("XMARK_VAR_DIR", str(tmp_path / "var"))

    # the command runs its own event loop (as from a shell): off this test's loop
    assert await asyncio.to_thread(_run, report_file, "--public-key", public_key, "--text", text_file) == 0
    out = capsys.readouterr().out
    assert "signature valid" in out and "text matches" in out and "agrees with the report" in out

    # one changed byte of the text
    text_file.write_text(text[:-1] + ("a" if text[-1] != "a" else "b"), encoding="utf-8")
    assert _run(report_file, "--public-key", public_key, "--text", text_file) == 1
    assert "SHA-256 differs" in capsys.readouterr().err

    # one changed byte of the report
    tampered = json.loads(json.dumps(document))
    tampered["report"]["p_value"] = tampered["report"]["p_value"] * 1.0000001 + 1e-300
    report_file.write_text(json.dumps(tampered))
    assert _run(report_file, "--public-key", public_key) == 1
    assert "does not match" in capsys.readouterr().err
    raw = bytearray(json.dumps(document).encode())
    at = raw.index(b'"verdict": "w') + len(b'"verdict": "')
    raw[at] = ord("W")
    report_file.write_bytes(bytes(raw))
    assert _run(report_file, "--public-key", public_key) == 1

    # another server's key
    report_file.write_text(json.dumps(document))
    other = ReportSigner.from_secret(b"some-other-gateway-secret-5b1f0e")
    assert _run(report_file, "--public-key", base64.b64encode(other.public_key).decode()) == 1
    assert "signed by key" in capsys.readouterr().err
    assert _run(report_file, "--public-key", "not base64!") == 1


@contextlib.contextmanager
def _key_server(body: dict[str, Any]) -> Iterator[str]:
    """A gateway stand-in serving ``body`` at the report-key path (a real HTTP server)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            payload = json.dumps(body).encode() if self.path == "/.well-known/xmark-report-key" else b"{}"
            self.send_response(200 if payload != b"{}" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_verify_report_reads_the_key_from_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    signer = ReportSigner.from_secret(b"a-gateway-secret-for-this-test-0042")
    report = {"report_id": "trc_x", "verdict": "not_watermarked", "p_value": 0.25, "attributed_user_id": None}
    document = {
        "object": "trace.report",
        "report": report,
        "signature": {"alg": "Ed25519", "key_id": signer.key_id, "value": signer.sign(report)},
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(document))
    key = {"alg": "Ed25519", "key_id": signer.key_id, "public_key": signer.public_key_b64}
    with _key_server(key) as url:
        assert _run(path, "--server", url) == 0
    assert "signature valid" in capsys.readouterr().out
    with _key_server({**key, "key_id": "0" * 16}) as url:  # a key that is not what it says
        assert _run(path, "--server", url) == 1
    assert "does not match" in capsys.readouterr().err
    other = ReportSigner.from_secret(b"another-gateway-secret-for-test-77")
    with _key_server({"alg": "Ed25519", "key_id": other.key_id, "public_key": other.public_key_b64}) as url:
        assert _run(path, "--server", url) == 1
    assert "signed by key" in capsys.readouterr().err
    document["signature"] = None
    path.write_text(json.dumps(document))
    assert _run(path, "--public-key", signer.public_key_b64) == 1
    assert "no signature" in capsys.readouterr().err
