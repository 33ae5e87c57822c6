"""The per-process authentication cache: hits need no database, changes made here apply at once,
changes made elsewhere within the TTL, only HMACs of keys are ever stored, and refused keys are
remembered for a short while (negative cache) without ever blocking a valid key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import AuthenticationError, PermissionDeniedError
from service.models import ApiKey, User
from service.schemas.common import MessageIdOut, Principal
from service.security import generate_api_key, parse_api_key
from service.services.auth_cache import AuthCache, CachedPrincipal

TTL = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _principal(user_id: int = 1, api_key_id: int = 1) -> Principal:
    return Principal(
        user_id=user_id,
        name="u",
        role="user",
        api_key_id=api_key_id,
        message_ids=(MessageIdOut(bits=32, block_bits=2, message_id="0" * 32),),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cache(app: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> AuthCache:
    """A fresh cache with a controllable clock, installed in the app for this test."""
    fresh = AuthCache(TTL, 1000, clock=clock)
    monkeypatch.setattr(app.state.resources.authenticator, "cache", fresh)
    return fresh


@pytest.fixture
def sql(app: Any) -> Iterator[list[str]]:
    """Every SQL statement the app's engine sends while the test runs."""
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    engine = app.state.resources.engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


async def _key_id(session: AsyncSession, user_id: int) -> int:
    return int((await session.scalars(select(ApiKey.id).where(ApiKey.user_id == user_id))).one())


# -- the cache itself --------------------------------------------------------------------------


def test_entries_expire_after_the_ttl(clock: FakeClock) -> None:
    cache = AuthCache(TTL, clock=clock)
    assert cache.put("h", CachedPrincipal(_principal(), None), epoch=cache.epoch)
    clock.advance(TTL - 0.01)
    assert cache.get("h") is not None
    clock.advance(0.02)
    assert cache.get("h") is None and "h" not in cache


def test_size_is_bounded_least_recently_used_first(clock: FakeClock) -> None:
    cache = AuthCache(TTL, 3, clock=clock)
    for name in "abc":
        cache.put(name, CachedPrincipal(_principal(), None), epoch=cache.epoch)
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", CachedPrincipal(_principal(), None), epoch=cache.epoch)
    assert len(cache) == 3 and "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}


def test_a_lookup_that_raced_with_an_invalidation_is_not_stored(clock: FakeClock) -> None:
    cache = AuthCache(TTL, clock=clock)
    epoch = cache.epoch  # a lookup starts reading the database ...
    cache.invalidate_user(7)  # ... while the user is changed
    assert not cache.put("h", CachedPrincipal(_principal(7), None), epoch=epoch)
    assert "h" not in cache


def test_invalidation_drops_only_the_affected_entries(clock: FakeClock) -> None:
    cache = AuthCache(TTL, clock=clock)
    cache.put("u1k1", CachedPrincipal(_principal(1, 1), None), epoch=cache.epoch)
    cache.put("u1k2", CachedPrincipal(_principal(1, 2), None), epoch=cache.epoch)
    cache.put("u2k3", CachedPrincipal(_principal(2, 3), None), epoch=cache.epoch)
    cache.invalidate_key(2)
    assert "u1k2" not in cache and "u1k1" in cache and "u2k3" in cache
    cache.invalidate_user(1)
    assert "u1k1" not in cache and "u2k3" in cache


def test_ttl_zero_disables_the_cache(clock: FakeClock) -> None:
    cache = AuthCache(0, clock=clock)
    assert not cache.enabled
    assert not cache.put("h", CachedPrincipal(_principal(), None), epoch=cache.epoch)
    assert cache.get("h") is None


async def test_a_change_is_invalidated_again_when_its_session_commits(
    clock: FakeClock, db_session: AsyncSession
) -> None:
    cache = AuthCache(TTL, clock=clock)
    cache.invalidate_key(5, db_session)  # the change is flushed, not committed yet
    # a concurrent lookup read the row as last committed and stores it after the first drop
    assert cache.put("h", CachedPrincipal(_principal(1, 5), None), epoch=cache.epoch)
    await db_session.commit()
    assert "h" not in cache


# -- through the app ---------------------------------------------------------------------------


async def test_a_cached_key_needs_no_database_round_trip(
    client: httpx.AsyncClient, make_user: Any, cache: AuthCache, sql: list[str]
) -> None:
    _, key = await make_user("user")
    first = await client.get("/v1/models", headers=bearer(key))
    assert first.status_code == 200
    assert any("api_keys" in statement for statement in sql)  # a miss reads the key
    sql.clear()
    for _ in range(3):
        again = await client.get("/v1/models", headers=bearer(key))
        assert again.status_code == 200
    assert sql == []
    assert cache.hits == 3


async def test_a_burst_of_one_key_on_a_cold_cache_is_one_database_read(
    client: httpx.AsyncClient, make_user: Any, cache: AuthCache, sql: list[str]
) -> None:
    """Concurrent misses of one key share one read: a burst must not take a connection per request
    (at 256 concurrent requests that emptied the pool and answered 503)."""
    _, key = await make_user("user")
    sql.clear()
    responses = await asyncio.gather(*(client.get("/v1/models", headers=bearer(key)) for _ in range(32)))
    assert [r.status_code for r in responses] == [200] * 32
    reads = [s for s in sql if "api_keys" in s and s.lstrip().upper().startswith("SELECT")]
    assert len(reads) == 1, reads
    sql.clear()
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert sql == []  # and the result is cached


async def test_only_the_hmac_of_the_key_is_a_cache_key(
    app: Any, client: httpx.AsyncClient, make_user: Any, cache: AuthCache
) -> None:
    _, key = await make_user("user")
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    stored = list(cache._entries)
    assert stored == [app.state.resources.api_key_hasher.hash(parse_api_key(key))]
    for cache_key, entry in cache._entries.items():
        assert key not in cache_key and cache_key not in key
        assert key not in repr(entry)
    assert key.split("_")[1] not in repr(cache._entries)


async def test_refused_keys_are_not_cached_when_refusal_caching_is_off(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, cache: AuthCache, sql: list[str]
) -> None:
    for _ in range(20):
        unknown = generate_api_key().plaintext
        assert (await client.get("/v1/models", headers=bearer(unknown))).status_code == 401
    principal, key = await make_user("user")
    disabled = await client.post(f"/admin/users/{principal['id']}/disable", headers=bearer(admin_key))
    assert disabled.status_code == 200
    before = len(cache)  # the admin's own key
    sql.clear()
    for _ in range(2):
        assert (await client.get("/v1/models", headers=bearer(key))).status_code == 403
    assert len(cache) == before
    assert sum("api_keys" in statement for statement in sql) == 2  # asked the database each time


async def test_revoking_a_cached_key_takes_effect_on_the_next_request(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, cache: AuthCache, db_session: AsyncSession
) -> None:
    principal, key = await make_user("user")
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    key_id = await _key_id(db_session, principal["id"])
    revoked = await client.post(f"/admin/users/{principal['id']}/keys/{key_id}/revoke", headers=bearer(admin_key))
    assert revoked.status_code == 200
    response = await client.get("/v1/models", headers=bearer(key))
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]


async def test_disabling_enabling_and_deleting_take_effect_on_the_next_request(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, cache: AuthCache
) -> None:
    principal, key = await make_user("user")
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert (await client.post(f"/admin/users/{principal['id']}/disable", headers=bearer(admin_key))).status_code == 200
    disabled = await client.get("/v1/models", headers=bearer(key))
    assert disabled.status_code == 403 and disabled.json()["error"]["code"] == "user_disabled"
    assert (await client.post(f"/admin/users/{principal['id']}/enable", headers=bearer(admin_key))).status_code == 200
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert (await client.delete(f"/admin/users/{principal['id']}", headers=bearer(admin_key))).status_code == 200
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 401


async def test_an_admin_disabled_through_the_api_loses_admin_access_at_once(
    client: httpx.AsyncClient, make_user: Any, admin_key: str, cache: AuthCache
) -> None:
    principal, other_admin = await make_user("admin")
    assert (await client.get("/admin/users", headers=bearer(other_admin))).status_code == 200
    assert (await client.post(f"/admin/users/{principal['id']}/disable", headers=bearer(admin_key))).status_code == 200
    assert (await client.get("/admin/users", headers=bearer(other_admin))).status_code == 403


async def test_changes_made_elsewhere_apply_once_the_ttl_has_passed(
    client: httpx.AsyncClient, make_user: Any, cache: AuthCache, clock: FakeClock, db_session: AsyncSession
) -> None:
    principal, key = await make_user("admin")
    assert (await client.get("/admin/users", headers=bearer(key))).status_code == 200
    # another replica demotes the user: this process is not told
    await db_session.execute(update(User).where(User.id == principal["id"]).values(role="user"))
    await db_session.commit()
    clock.advance(TTL - 0.5)
    assert (await client.get("/admin/users", headers=bearer(key))).status_code == 200  # within the TTL
    clock.advance(1.0)
    demoted = await client.get("/admin/users", headers=bearer(key))
    assert demoted.status_code == 403 and demoted.json()["error"]["code"] == "insufficient_role"
    # and a key revoked elsewhere
    await db_session.execute(
        update(ApiKey).where(ApiKey.user_id == principal["id"]).values(revoked_at=datetime.now(UTC))
    )
    await db_session.commit()
    clock.advance(TTL + 0.1)
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 401


async def test_a_keys_first_request_reads_it_in_one_statement_and_writes_nothing(
    app: Any, client: httpx.AsyncClient, make_user: Any, cache: AuthCache, sql: list[str]
) -> None:
    """The cold path: the key, its user and the user's message IDs in one SELECT; the use is noted,
    not written, so the request waits for no write."""
    _, key = await make_user("user")
    last_use = app.state.resources.authenticator.last_use
    pending = last_use.pending
    sql.clear()
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    statements = [s for s in sql if not s.upper().startswith(("SAVEPOINT", "RELEASE SAVEPOINT"))]
    assert len(statements) == 1, statements
    assert statements[0].lstrip().upper().startswith("SELECT") and "message_ids" in statements[0]
    assert last_use.pending == pending + 1


async def test_last_use_is_written_once_its_resolution_has_passed(
    app: Any, client: httpx.AsyncClient, make_user: Any, cache: AuthCache, sql: list[str], db_session: AsyncSession
) -> None:
    principal, key = await make_user("user")
    last_use = app.state.resources.authenticator.last_use
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    key_id = await _key_id(db_session, principal["id"])
    assert await db_session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id)) is None  # not yet
    sql.clear()
    await last_use.flush()  # what the background writer does every second
    writes = [s for s in sql if not s.upper().startswith(("SAVEPOINT", "RELEASE SAVEPOINT"))]
    assert len(writes) == 1 and writes[0].lstrip().upper().startswith("UPDATE API_KEYS"), writes
    first_use = await db_session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id))
    assert first_use is not None and last_use.pending == 0
    sql.clear()
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert sql == [] and last_use.pending == 0  # within the minute: nothing read, nothing noted
    entry = cache.get(app.state.resources.api_key_hasher.hash(parse_api_key(key)))
    assert entry is not None
    entry.last_used_at = first_use - timedelta(minutes=2)  # as if the last write were older
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert sql == [] and last_use.pending == 1  # noted: the request itself sends nothing
    await last_use.flush()
    db_session.expire_all()
    later = await db_session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id))
    assert later is not None and later > first_use


async def test_listing_keys_shows_the_uses_not_written_yet(
    app: Any, client: httpx.AsyncClient, make_user: Any, cache: AuthCache
) -> None:
    """The admin API's key listings write their process's pending uses first."""
    principal, key = await make_user("user")
    _, admin_key = await make_user("admin")
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert app.state.resources.authenticator.last_use.pending >= 1
    listed = (await client.get(f"/admin/users/{principal['id']}/keys", headers=bearer(admin_key))).json()
    assert listed["data"][0]["last_used_at"] is not None
    found = (await client.get(f"/admin/api-keys?user_id={principal['id']}", headers=bearer(admin_key))).json()
    assert found["data"][0]["last_used_at"] is not None


async def test_ttl_zero_asks_the_database_every_time(
    app: Any, client: httpx.AsyncClient, make_user: Any, monkeypatch: pytest.MonkeyPatch, sql: list[str]
) -> None:
    monkeypatch.setattr(app.state.resources.authenticator, "cache", AuthCache(0))
    _, key = await make_user("user")
    for _ in range(3):
        assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    assert sum("api_keys" in s and s.lstrip().upper().startswith("SELECT") for s in sql) == 3


# -- refused keys (negative cache) -------------------------------------------------------------

REFUSAL_TTL = 10.0


@pytest.fixture
def refusing(app: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> AuthCache:
    """A fresh cache that also remembers refusals, installed in the app for this test."""
    fresh = AuthCache(TTL, 1000, refusal_ttl=REFUSAL_TTL, refusal_max_entries=50, clock=clock)
    monkeypatch.setattr(app.state.resources.authenticator, "cache", fresh)
    return fresh


def _key_queries(sql: list[str]) -> int:
    return sum("api_keys" in s and s.lstrip().upper().startswith("SELECT") for s in sql)


def test_the_gateway_remembers_refusals_for_the_configured_time(app: Any, settings: Any) -> None:
    assert settings.auth_negative_cache_ttl_s > 0
    assert app.state.resources.authenticator.cache.refusal_ttl == settings.auth_negative_cache_ttl_s


async def test_a_refused_key_is_answered_again_without_a_database_query(
    app: Any, client: httpx.AsyncClient, make_user: Any, refusing: AuthCache, sql: list[str], clock: FakeClock
) -> None:
    unknown = generate_api_key().plaintext
    first = await client.get("/v1/models", headers=bearer(unknown))
    assert first.status_code == 401 and _key_queries(sql) == 1
    sql.clear()
    for _ in range(5):
        again = await client.get("/v1/models", headers=bearer(unknown))
        assert again.status_code == 401
        assert again.json() == first.json() and again.headers["www-authenticate"] == "Bearer"
    assert sql == [] and refusing.refusal_hits == 5
    # only the HMAC is kept
    assert list(refusing._refusals) == [app.state.resources.api_key_hasher.hash(parse_api_key(unknown))]
    assert unknown not in repr(refusing._refusals) and unknown.split("_")[1] not in repr(refusing._refusals)
    # a valid key is unaffected, and a key issued now is not held up by refusals
    _, key = await make_user("user")
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
    # after the TTL the database is asked again
    clock.advance(REFUSAL_TTL + 0.1)
    sql.clear()
    assert (await client.get("/v1/models", headers=bearer(unknown))).status_code == 401
    assert _key_queries(sql) == 1


async def test_revoked_keys_and_disabled_users_are_remembered_until_an_admin_lifts_them(
    client: httpx.AsyncClient,
    make_user: Any,
    admin_key: str,
    refusing: AuthCache,
    sql: list[str],
    db_session: AsyncSession,
) -> None:
    principal, key = await make_user("user")
    assert (await client.post(f"/admin/users/{principal['id']}/disable", headers=bearer(admin_key))).status_code == 200
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 403
    sql.clear()
    cached = await client.get("/v1/models", headers=bearer(key))
    assert cached.status_code == 403 and cached.json()["error"]["code"] == "user_disabled"
    assert _key_queries(sql) == 0
    # enabled again: served on the very next request
    assert (await client.post(f"/admin/users/{principal['id']}/enable", headers=bearer(admin_key))).status_code == 200
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200

    key_id = await _key_id(db_session, principal["id"])
    revoke = await client.post(f"/admin/users/{principal['id']}/keys/{key_id}/revoke", headers=bearer(admin_key))
    assert revoke.status_code == 200
    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 401
    sql.clear()
    again = await client.get("/v1/models", headers=bearer(key))
    assert again.status_code == 401 and "revoked" in again.json()["error"]["message"]
    assert _key_queries(sql) == 0


def test_refusals_are_bounded_and_never_evict_accepted_keys(clock: FakeClock) -> None:
    cache = AuthCache(TTL, 10, refusal_ttl=REFUSAL_TTL, refusal_max_entries=3, clock=clock)
    cache.put("accepted", CachedPrincipal(_principal(), None), epoch=cache.epoch)
    refused = AuthenticationError("Invalid API key")
    for i in range(100):
        cache.put_refusal(f"refused-{i}", refused, epoch=cache.epoch)
    assert cache.refusals == 3 and set(cache._refusals) == {"refused-97", "refused-98", "refused-99"}
    assert cache.get("accepted") is not None
    error = cache.refusal("refused-99")
    assert isinstance(error, AuthenticationError) and error is not refused and error.message == refused.message
    clock.advance(REFUSAL_TTL)
    assert cache.refusal("refused-99") is None


def test_a_refusal_that_raced_with_an_invalidation_is_not_stored(clock: FakeClock) -> None:
    cache = AuthCache(TTL, refusal_ttl=REFUSAL_TTL, clock=clock)
    epoch = cache.epoch
    cache.invalidate_user(1)  # e.g. the user was enabled while the lookup read the disabled row
    assert not cache.put_refusal("h", PermissionDeniedError("This user is disabled", code="user_disabled"), epoch=epoch)
    assert cache.refusal("h") is None


def test_user_changes_lift_403s_but_not_401s(clock: FakeClock) -> None:
    cache = AuthCache(TTL, refusal_ttl=REFUSAL_TTL, clock=clock)
    cache.put_refusal("disabled", PermissionDeniedError("This user is disabled", code="user_disabled"), epoch=0)
    cache.put_refusal("unknown", AuthenticationError("Invalid API key"), epoch=0)
    cache.invalidate_user(42)
    assert cache.refusal("disabled") is None
    assert isinstance(cache.refusal("unknown"), AuthenticationError)
    assert not AuthCache(TTL).put_refusal("x", AuthenticationError("Invalid API key"), epoch=0)  # off by default
