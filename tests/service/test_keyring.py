"""Key-version sync: registration, fingerprint checks, active/usable versions."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.keyring import Keyring, KeyringError
from service.models import KeyVersion
from xmark_core import WatermarkKey, WatermarkParams

PARAMS = WatermarkParams()
S1 = b"keyring-test-secret-one-3b9f1c2d"
S2 = b"keyring-test-secret-two-8e4a6d0f"


@pytest.fixture
async def empty_versions(db_session: AsyncSession) -> AsyncSession:
    """The test transaction with no key_versions rows (rolled back afterwards)."""
    await db_session.execute(delete(KeyVersion))
    await db_session.flush()
    return db_session


async def _rows(session: AsyncSession) -> dict[str, KeyVersion]:
    return {r.name: r for r in (await session.scalars(select(KeyVersion))).all()}


async def test_first_sync_registers_first_active_then_pending(empty_versions: AsyncSession) -> None:
    keyring = Keyring(PARAMS, {"a": S1, "b": S2})
    await keyring.sync(empty_versions)
    rows = await _rows(empty_versions)
    assert {n: r.status for n, r in rows.items()} == {"a": "active", "b": "pending"}
    assert rows["a"].fingerprint == WatermarkKey.from_secret(S1, PARAMS).fingerprint
    assert (rows["a"].bits, rows["a"].block_bits, rows["a"].num_keys, rows["a"].delta, rows["a"].scheme) == (
        16,
        2,
        2,
        2.0,
        "xmark",
    )
    for row in rows.values():  # the secret itself is never stored
        for column in KeyVersion.__table__.columns:
            assert str(getattr(row, column.key)) not in (S1.decode(), S2.decode())
    assert keyring.active().name == "a"
    assert [h.name for h in keyring.usable()] == ["a", "b"]
    assert keyring.active().key.fingerprint == rows["a"].fingerprint

    # a second replica with the same configuration agrees and adds nothing
    again = Keyring(PARAMS, {"a": S1, "b": S2})
    await again.sync(empty_versions)
    assert len(await _rows(empty_versions)) == 2 and again.active().name == "a"


async def test_fingerprint_mismatch_stops_start_up(empty_versions: AsyncSession) -> None:
    await Keyring(PARAMS, {"a": S1}).sync(empty_versions)
    wrong = Keyring(PARAMS, {"a": S2})
    with pytest.raises(KeyringError, match="fingerprint") as info:
        await wrong.sync(empty_versions)
    message = str(info.value)
    assert "'a'" in message and S1.decode() not in message and S2.decode() not in message


async def test_versions_of_different_message_lengths_coexist(empty_versions: AsyncSession) -> None:
    """A 16-bit deployment configured for 32 bits: the old row keeps its length, new rows get 32."""
    await Keyring(PARAMS, {"a": S1}).sync(empty_versions)
    keyring = Keyring(WatermarkParams(bits=32), {"a": S1, "b": S2})
    await keyring.sync(empty_versions)
    rows = await _rows(empty_versions)
    assert (rows["a"].bits, rows["a"].status, rows["b"].bits, rows["b"].status) == (16, "active", 32, "pending")
    assert rows["b"].fingerprint == WatermarkKey.from_secret(S2, WatermarkParams(bits=32)).fingerprint
    handles = {h.name: h for h in keyring.usable()}
    assert handles["a"].key.params.bits == 16 and handles["b"].key.params.bits == 32
    assert keyring.active().name == "a" and keyring.params.bits == 32
    assert keyring.lengths() == {(16, 2), (32, 2)}
    # the fingerprint check still holds for a row of another length than the configured one
    with pytest.raises(KeyringError, match="fingerprint"):
        await Keyring(WatermarkParams(bits=32), {"a": S2}).sync(empty_versions)


async def test_an_active_version_of_another_length_than_configured_is_warned_of(
    empty_versions: AsyncSession, caplog: pytest.LogCaptureFixture
) -> None:
    """An upgrade across the default length's change: the active 32-bit version keeps encoding,
    and start-up says that vLLM workers, which read XMARK_WATERMARK_BITS, must keep its length."""
    await Keyring(WatermarkParams(bits=32), {"a": S1}).sync(empty_versions)
    with caplog.at_level("WARNING", logger="xmark.keyring"):
        await Keyring(WatermarkParams(bits=32), {"a": S1}).sync(empty_versions)
    assert not [r for r in caplog.records if "message length" in r.getMessage()]
    with caplog.at_level("WARNING", logger="xmark.keyring"):
        keyring = Keyring(WatermarkParams(bits=64), {"a": S1})
        await keyring.sync(empty_versions)
    (record,) = [r for r in caplog.records if "message length" in r.getMessage()]
    assert (record.key_version, record.active_bits, record.configured_bits) == ("a", 32, 64)
    assert keyring.active().key.params.bits == 32


async def test_rows_keep_their_own_parameters(empty_versions: AsyncSession) -> None:
    await Keyring(WatermarkParams(delta=2.0), {"a": S1}).sync(empty_versions)
    keyring = Keyring(WatermarkParams(delta=3.0), {"a": S1, "b": S2})
    await keyring.sync(empty_versions)
    handles = {h.name: h for h in keyring.usable()}
    assert handles["a"].key.params.delta == 2.0  # old text stays traceable
    assert handles["b"].key.params.delta == 3.0


async def test_a_key_version_records_its_entropy_rule(empty_versions: AsyncSession) -> None:
    """Versions made before the rule keep biasing (and tracing) every position; a version made with
    XMARK_WATERMARK_MIN_ENTROPY set stores the threshold in its row and fingerprint, and a process
    configured otherwise still reads each row with its own rule."""
    await Keyring(PARAMS, {"a": S1}).sync(empty_versions)
    rule = WatermarkParams(min_entropy=0.69)
    keyring = Keyring(rule, {"a": S1, "b": S2})
    await keyring.sync(empty_versions)
    rows = await _rows(empty_versions)
    assert (rows["a"].min_entropy, rows["b"].min_entropy) == (0.0, 0.69)
    assert rows["a"].fingerprint == WatermarkKey.from_secret(S1, PARAMS).fingerprint
    assert rows["b"].fingerprint == WatermarkKey.from_secret(S2, rule).fingerprint
    assert rows["b"].fingerprint != WatermarkKey.from_secret(S2, PARAMS).fingerprint
    later = Keyring(PARAMS, {"a": S1, "b": S2})
    await later.sync(empty_versions)
    handles = {h.name: h for h in later.usable()}
    assert handles["a"].key.params.min_entropy == 0.0
    assert handles["b"].key.params == rule


async def test_no_configured_active_version_is_an_error(empty_versions: AsyncSession) -> None:
    await Keyring(PARAMS, {"a": S1}).sync(empty_versions)
    with pytest.raises(KeyringError, match="no active key version"):
        await Keyring(PARAMS, {"b": S2}).sync(empty_versions)


async def test_retired_and_unconfigured_versions_are_not_usable(empty_versions: AsyncSession) -> None:
    keyring = Keyring(PARAMS, {"a": S1, "b": S2})
    await keyring.sync(empty_versions)
    rows = await _rows(empty_versions)
    rows["b"].status = "active"
    await empty_versions.flush()
    await keyring.refresh(empty_versions)
    assert {h.name for h in keyring.usable()} == {"a", "b"}
    rows["a"].status = "retired"
    await empty_versions.flush()
    await keyring.refresh(empty_versions)
    assert [h.name for h in keyring.usable()] == ["b"] and keyring.active().name == "b"

    only_b = Keyring(PARAMS, {"b": S2})
    await only_b.sync(empty_versions)
    assert [h.name for h in only_b.usable()] == ["b"]
    assert S1.decode() not in repr(only_b) and S2.decode() not in repr(only_b)


async def test_app_start_refuses_a_mismatched_secret(settings: Any, app: Any) -> None:
    """The configured test secrets are registered; starting with another v1 secret fails."""
    from service.app import create_app

    changed = settings.model_copy(update={"watermark_secrets": SecretStr("v1:another-secret-for-v1-7c1e9a5b3d")})
    other = create_app(changed)
    with pytest.raises(KeyringError, match="'v1'"):
        async with other.router.lifespan_context(other):
            pass
