"""The CLI's registry changes are recorded (actor ``cli``), the start-up writes of ``xmark serve``
too (actor ``system``), and ``xmark verify-audit`` checks the trail offline: exit 0 when intact, 1
naming the first entry that was altered, removed, or cut from the end, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.pg_admin import create_database, drop_database, sibling_url
from service.app import prepare_database
from service.cli import main
from service.config import Settings, load_secrets
from service.models import RegistryAuditEntry
from service.security import generate_api_key
from service.services.audit import entry_hash, entry_payload
from service.services.reports import ReportSigner
from tests.conftest import TEST_API_KEY_PEPPER, TEST_DATABASE_URL, TEST_WATERMARK_SECRETS

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def database(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An empty database for the CLI (XMARK_DATABASE_URL): an embedded SQLite file, or a PostgreSQL
    database beside the test database (created and dropped here)."""
    var = tmp_path / "var"
    monkeypatch.setenv("XMARK_VAR_DIR", str(var))
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{var / 'xmark.db'}"
        monkeypatch.setenv("XMARK_DATABASE_URL", url)
        yield url
        return
    url = sibling_url(TEST_DATABASE_URL, f"xmark_auditcli_{uuid.uuid4().hex[:10]}")
    monkeypatch.setenv("XMARK_DATABASE_URL", url)
    monkeypatch.setenv("XMARK_WATERMARK_SECRETS", ",".join(f"{k}:{v}" for k, v in TEST_WATERMARK_SECRETS.items()))
    monkeypatch.setenv("XMARK_API_KEY_PEPPER", TEST_API_KEY_PEPPER)
    asyncio.run(create_database(url))
    try:
        yield url
    finally:
        asyncio.run(drop_database(url))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _sql(url: str, statement: str, params: dict[str, Any] | None = None) -> list[Any]:
    async def work() -> list[Any]:
        engine = create_async_engine(url, poolclass=NullPool)
        try:
            async with engine.begin() as connection:
                result = await connection.execute(text(statement), params or {})
                return [tuple(row) for row in result.all()] if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(work())


def _entries(url: str) -> list[dict[str, Any]]:
    rows = _sql(
        url,
        "SELECT seq, actor_kind, actor_user_id, action, target_type, target_id, changes, request_id, entry_hash "
        "FROM registry_audit ORDER BY seq",
    )
    names = ("seq", "actor_kind", "actor_user_id", "action", "target_type", "target_id", "changes", "request_id")
    entries = []
    for row in rows:
        entry = dict(zip(names, row[:-1], strict=True))
        if isinstance(entry["changes"], str):  # SQLite hands JSON back as text through text()
            entry["changes"] = json.loads(entry["changes"])
        entry["entry_hash"] = row[-1]
        entries.append(entry)
    return entries


def _public_key_b64() -> str:
    return ReportSigner.from_secret(load_secrets(Settings()).report_signing).public_key_b64


def test_cli_changes_are_recorded_and_the_trail_verifies(
    database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _run(capsys, "migrate")[0] == 0
    code, out, _ = _run(capsys, "verify-audit")
    assert code == 0 and "no entries yet" in out and "0" * 64 in out

    code, out, _ = _run(capsys, "create-admin", "--if-none", "--json")
    assert code == 0
    admin = json.loads(out)
    code, out, _ = _run(capsys, "create-admin", "--name", "second-admin", "--json")
    assert code == 0
    second = json.loads(out)
    code, out, _ = _run(capsys, "create-user", "alice", "--role", "auditor", "--json")
    assert code == 0
    alice = json.loads(out)
    # nothing created, nothing recorded
    assert _run(capsys, "create-admin", "--if-none")[0] == 0

    entries = _entries(database)
    assert [(e["seq"], e["actor_kind"], e["actor_user_id"], e["request_id"]) for e in entries] == [
        (1, "cli", None, None),
        (2, "cli", None, None),
        (3, "cli", None, None),
    ]
    assert [(e["action"], e["target_type"], e["target_id"]) for e in entries] == [
        ("user.create", "user", str(admin["id"])),
        ("user.create", "user", str(second["id"])),
        ("user.create", "user", str(alice["id"])),
    ]
    after = entries[2]["changes"]["after"]
    assert (after["name"], after["role"], after["status"]) == ("alice", "auditor", "active")
    assert after["message_ids"] == alice["message_ids"]
    assert after["api_key"]["prefix"] == alice["api_key"][: len(after["api_key"]["prefix"])]
    hashes = [row[0] for row in _sql(database, "SELECT key_hash FROM api_keys")]
    dumped = json.dumps(entries)
    for secret in (admin["api_key"], second["api_key"], alice["api_key"], *hashes):
        assert secret not in dumped

    code, out, err = _run(capsys, "verify-audit")
    assert code == 0, err
    assert out.count("\n") == 1 and "intact: 3 entries" in out and entries[-1]["entry_hash"] in out
    # the key given, or an exported head still in the trail
    assert _run(capsys, "verify-audit", "--public-key", _public_key_b64())[0] == 0
    assert _run(capsys, "verify-audit", "--anchor", f"2:{entries[1]['entry_hash']}")[0] == 0
    code, _, err = _run(capsys, "verify-audit", "--anchor", f"2:{'ab' * 32}")
    assert code == 1 and "entry 2 altered" in err and "anchor" in err
    code, _, err = _run(capsys, "verify-audit", "--anchor", f"7:{'ab' * 32}")
    assert code == 1 and "entry 4 truncated" in err
    # another gateway's key: every signature is foreign
    other = ReportSigner.from_secret(b"another gateway's signing secret").public_key_b64
    code, _, err = _run(capsys, "verify-audit", "--public-key", other)
    assert code == 1 and "entry 1 altered" in err and "signed by key" in err
    # an older key beside the current one (after the signing secret changed)
    assert _run(capsys, "verify-audit", "--public-key", other, "--public-key", _public_key_b64())[0] == 0
    for bad in (["--public-key", "not base64!"], ["--anchor", "two:abc"]):
        code, _, err = _run(capsys, "verify-audit", *bad)
        assert code == 1 and err.startswith("xmark: error:")
    # the URL given instead of XMARK_DATABASE_URL
    monkeypatch.setenv("XMARK_DATABASE_URL", "sqlite+aiosqlite:////nonexistent/elsewhere.db")
    assert _run(capsys, "verify-audit", "--database-url", database)[0] == 0


def _tamper_altered(url: str) -> None:
    changes = json.dumps({"before": None, "after": {"name": "mallory", "role": "admin"}})
    _sql(url, "UPDATE registry_audit SET changes = :changes WHERE seq = 2", {"changes": changes})


def _tamper_rehashed(url: str) -> None:
    """Altered, and the entry's hash recomputed to match: only the signature still tells."""
    _tamper_altered(url)

    async def work() -> None:
        engine = create_async_engine(url, poolclass=NullPool)
        try:
            async with AsyncSession(engine) as session:
                row = await session.get(RegistryAuditEntry, 2)
                assert row is not None
                row.entry_hash = entry_hash(entry_payload(row))
                await session.commit()
        finally:
            await engine.dispose()

    asyncio.run(work())


def _tamper_removed(url: str) -> None:
    _sql(url, "DELETE FROM registry_audit WHERE seq = 2")


def _tamper_truncated(url: str) -> None:
    _sql(url, "DELETE FROM registry_audit WHERE seq = 3")  # the head row is left alone


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        (_tamper_altered, "entry 2 altered: its hash does not match"),
        (_tamper_rehashed, "entry 2 altered: its signature does not match"),
        (_tamper_removed, "entry 2 removed: entry 3 follows entry 1"),
        (_tamper_truncated, "entry 3 truncated: the head says the trail holds 3 entries, it ends at entry 2"),
    ],
    ids=["altered", "rehashed", "removed", "truncated"],
)
def test_verify_audit_names_the_first_bad_entry(
    database: str, capsys: pytest.CaptureFixture[str], tamper: Any, expected: str
) -> None:
    assert _run(capsys, "migrate")[0] == 0
    for name in ("one", "two", "three"):
        assert _run(capsys, "create-user", name)[0] == 0
    assert _run(capsys, "verify-audit")[0] == 0
    tamper(database)
    code, out, err = _run(capsys, "verify-audit")
    assert code == 1 and out == ""
    assert expected in err, err
    assert err.startswith("xmark: error: audit trail BROKEN at ")


def test_start_up_writes_are_recorded_as_the_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`xmark serve`'s start-up writes (prepare_database): the first key version activated, message
    IDs of its length for a user created before it, the bootstrap admin."""
    var = tmp_path / "var"
    url = f"sqlite+aiosqlite:///{var / 'xmark.db'}"
    monkeypatch.setenv("XMARK_DATABASE_URL", url)
    monkeypatch.setenv("XMARK_VAR_DIR", str(var))
    assert _run(capsys, "migrate")[0] == 0
    monkeypatch.setenv("XMARK_WATERMARK_BITS", "16")  # an older deployment's user, 16-bit IDs only
    code, out, _ = _run(capsys, "create-user", "early", "--json")
    assert code == 0
    early = json.loads(out)
    monkeypatch.delenv("XMARK_WATERMARK_BITS")
    monkeypatch.setenv("XMARK_BOOTSTRAP_ADMIN_KEY", generate_api_key().plaintext)
    asyncio.run(prepare_database(Settings()))
    asyncio.run(prepare_database(Settings()))  # a restart writes nothing, records nothing

    entries = _entries(url)
    assert [(e["actor_kind"], e["action"], e["target_type"]) for e in entries] == [
        ("cli", "user.create", "user"),
        ("system", "key_version.activate", "key_version"),
        ("system", "message_ids.allocate", "message_length"),
        ("system", "user.create", "user"),
    ]
    assert all(e["request_id"] is None for e in entries)
    activation = entries[1]["changes"]
    assert activation["before"] is None
    assert (activation["after"]["name"], activation["after"]["status"]) == ("v1", "active")
    assert activation["after"]["params"]["bits"] == 64
    assert entries[2]["target_id"] == "64/2"
    assert entries[2]["changes"]["after"] == {
        "bits": 64,
        "block_bits": 2,
        "allocated": 1,
        "user_ids": {"from": early["id"], "to": early["id"]},
    }
    assert entries[3]["changes"]["after"]["role"] == "admin"
    code, out, err = _run(capsys, "verify-audit")
    assert code == 0 and "intact: 4 entries" in out, err
