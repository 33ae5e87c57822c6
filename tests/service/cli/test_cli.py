"""The xmark CLI against a temporary embedded (SQLite) database."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sqlalchemy import update

from service.cli import main
from service.config import Settings, load_secrets
from service.db import create_engine, create_sessionmaker
from service.errors import AuthenticationError
from service.models import User
from service.schemas.common import Principal
from service.security import ApiKeyHasher, generate_api_key
from service.services.auth import Authenticator
from service.services.auth_cache import AuthCache
from service.services.last_use import LastUseRecorder


@pytest.fixture
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    var = tmp_path / "var"
    monkeypatch.setenv("XMARK_DATABASE_URL", f"sqlite+aiosqlite:///{var / 'xmark.db'}")
    monkeypatch.setenv("XMARK_VAR_DIR", str(var))
    return Settings()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _authenticate(settings: Settings, key: str) -> Principal:
    async def work() -> Principal:
        engine = create_engine(settings)
        try:
            hasher = ApiKeyHasher(load_secrets(settings).api_key_pepper)
            sessionmaker = create_sessionmaker(engine)
            last_use = LastUseRecorder(sessionmaker)
            authenticator = Authenticator(sessionmaker, hasher, AuthCache(0), last_use=last_use)
            principal = await authenticator.authenticate(f"Bearer {key}")
            await last_use.close()  # the use is written
            return principal
        finally:
            await engine.dispose()

    return asyncio.run(work())


def test_create_admin_user_and_list(embedded: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "migrate")[0] == 0

    code, out, _ = _run(capsys, "create-admin", "--if-none", "--json")
    assert code == 0
    admin = json.loads(out)
    assert admin["role"] == "admin" and admin["api_key"].startswith("xm_")
    assert _authenticate(embedded, admin["api_key"]).role == "admin"

    code, out, _ = _run(capsys, "create-admin", "--if-none")
    assert code == 0 and "already exists" in out and "xm_" not in out

    code, out, _ = _run(capsys, "create-user", "alice", "--role", "auditor")
    assert code == 0 and "not shown again" in out
    key = next(line.split()[-1] for line in out.splitlines() if line.startswith("api key:"))
    alice = _authenticate(embedded, key)
    assert alice.name == "alice" and alice.role == "auditor"

    code, out, _ = _run(capsys, "users", "--json")
    listing = json.loads(out)
    assert [(u["name"], u["role"], u["status"]) for u in listing["data"]] == [
        ("admin", "admin", "active"),
        ("alice", "auditor", "active"),
    ]
    assert "api_key" not in out and admin["api_key"] not in out
    # no key version is registered yet: alice holds an ID of each configured encoder's length (one:
    # the suite pins a single scheme), shown as message_id
    assert [(m.bits, m.block_bits) for m in alice.message_ids] == sorted(
        (p.bits, p.block_bits) for p in embedded.watermark_spec().encoders
    )
    assert listing["data"][1]["message_id"] == alice.message_ids[0].message_id
    assert listing["data"][1]["message_ids"] == [m.model_dump() for m in alice.message_ids]

    code, out, _ = _run(capsys, "users", "--role", "auditor")
    assert code == 0 and "alice" in out and "(1 of 1)" in out


def test_bootstrap_key_becomes_the_first_admins_key(
    embedded: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = generate_api_key().plaintext
    monkeypatch.setenv("XMARK_BOOTSTRAP_ADMIN_KEY", key)
    assert _run(capsys, "migrate")[0] == 0
    code, out, _ = _run(capsys, "create-admin", "--if-none")
    assert code == 0 and key not in out
    assert _authenticate(embedded, key).role == "admin"


def test_malformed_bootstrap_key_is_refused(
    embedded: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XMARK_BOOTSTRAP_ADMIN_KEY", "xm_not_a_real_key_value_12345")
    code, _, err = _run(capsys, "create-admin", "--if-none")
    assert code == 1
    assert "bootstrap_admin_key" in err and "xm_not_a_real_key_value_12345" not in err


def test_bad_arguments_and_unmigrated_database(embedded: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["create-user", "bob", "--role", "root"])
    assert info.value.code == 2
    capsys.readouterr()
    code, _, err = _run(capsys, "create-user", "bob")
    assert code == 1 and "xmark migrate" in err


def test_migrate_down_and_up(embedded: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "migrate")[0] == 0
    code, out, _ = _run(capsys, "migrate", "--downgrade", "base")
    assert code == 0 and "base" in out
    assert _run(capsys, "migrate")[0] == 0
    assert _run(capsys, "create-user", "carol")[0] == 0


def test_placeholder_secret_is_reported_without_the_value(
    embedded: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XMARK_WATERMARK_SECRETS", "v1:changemechangeme")
    code, _, err = _run(capsys, "users")
    assert code == 1 and "placeholder" in err and "changemechangeme" not in err


def test_a_mistyped_key_does_not_authenticate(embedded: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "migrate")[0] == 0
    _code, out, _ = _run(capsys, "create-user", "dora", "--json")
    key = json.loads(out)["api_key"]
    with pytest.raises(AuthenticationError):
        _authenticate(embedded, key[:-1] + ("0" if key[-1] != "0" else "1"))
    assert _authenticate(embedded, key).name == "dora"


def _set_status_of_every_admin(settings: Settings, status: str) -> None:
    """As another admin (or a replica's admin API) would: the first admin is no longer active."""

    async def work() -> None:
        engine = create_engine(settings)
        try:
            async with engine.begin() as connection:
                await connection.execute(update(User).where(User.role == "admin").values(status=status))
        finally:
            await engine.dispose()

    asyncio.run(work())


@pytest.mark.parametrize("status", ["disabled", "deleted"])
def test_if_none_creates_an_admin_when_no_active_one_remains_even_with_a_bootstrap_key(
    embedded: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, status: str
) -> None:
    bootstrap = generate_api_key().plaintext
    monkeypatch.setenv("XMARK_BOOTSTRAP_ADMIN_KEY", bootstrap)
    assert _run(capsys, "migrate")[0] == 0
    assert _run(capsys, "create-admin", "--if-none")[0] == 0
    _set_status_of_every_admin(embedded, status)

    # the bootstrap key belongs to the inactive admin (keys are never reused): a fresh one
    code, out, err = _run(capsys, "create-admin", "--if-none", "--json")
    assert code == 0, err
    created = json.loads(out)
    assert created["role"] == "admin" and created["api_key"] != bootstrap
    assert "fresh key" in err and bootstrap not in out + err
    assert _authenticate(embedded, created["api_key"]).role == "admin"

    code, out, _ = _run(capsys, "create-admin", "--if-none")
    assert code == 0 and "already exists" in out and "xm_" not in out


def test_if_none_counts_only_active_admins(embedded: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "migrate")[0] == 0
    code, out, _ = _run(capsys, "create-admin", "--if-none", "--json")
    first = json.loads(out)["api_key"]
    _set_status_of_every_admin(embedded, "disabled")
    code, out, _ = _run(capsys, "create-admin", "--if-none", "--json")
    assert code == 0
    second = json.loads(out)["api_key"]
    assert second != first and _authenticate(embedded, second).role == "admin"


def test_purge_sketches_drops_old_sketches_and_keeps_records(
    embedded: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import func, select

    from service.models import Generation
    from tests.service.provenance.test_provenance_sketch import ORIGINAL
    from tests.service.provenance.test_provenance_store import _seed

    assert _run(capsys, "migrate")[0] == 0

    async def seed_and_count(seed: bool) -> tuple[int, int]:
        engine = create_engine(embedded)
        try:
            async with create_sessionmaker(engine)() as session:
                if seed:
                    await _seed(session, [ORIGINAL, ORIGINAL], created_at=datetime.now(UTC) - timedelta(days=50))
                    await _seed(session, [ORIGINAL])
                    await session.commit()
                sketched = await session.scalar(
                    select(func.count()).select_from(Generation).where(Generation.sketch_terms.is_not(None))
                )
                records = await session.scalar(select(func.count()).select_from(Generation))
                return int(sketched or 0), int(records or 0)
        finally:
            await engine.dispose()

    assert asyncio.run(seed_and_count(True)) == (3, 3)
    code, out, _ = _run(capsys, "purge-sketches", "--days", "60")
    assert code == 0 and "of 0 completions" in out
    code, out, _ = _run(capsys, "purge-sketches", "--days", "30")
    assert code == 0 and "of 2 completions older than 30 days" in out
    assert asyncio.run(seed_and_count(False)) == (1, 3)
    code, out, _ = _run(capsys, "purge-sketches", "--days", "0")
    assert code == 0 and "every sketch is kept" in out
