"""Per-process cache of authenticated API keys, so a request does not need the database to know its caller.

* Key: the API key's HMAC under the pepper (the value stored in ``api_keys.key_hash``), never the
  plaintext key.
* Value: the resolved :class:`Principal` (user, role, message IDs, key id) and when the key's use
  was last written to ``api_keys.last_used_at``.
* An entry lives ``ttl`` seconds from the moment it was read from the database; the cache holds
  at most ``max_entries`` (least recently used ones leave first). ``ttl == 0`` disables it.
* Refusals are remembered apart, for ``refusal_ttl`` seconds (``XMARK_AUTH_NEGATIVE_CACHE_TTL_S``)
  and at most ``refusal_max_entries`` of them: a client repeating an unknown or revoked key (401)
  or the key of a disabled or deleted user (403) is answered without a database query. Anybody can
  fill this store with made-up keys, so it is bounded apart from the accepted keys and evicts its
  least recently used entries, never an accepted key's. A new key has a new HMAC, so issuing keys
  is never held up by it; a refusal that a change can lift (403: a user enabled again) is dropped
  by every user invalidation, like the accepted keys below.
* Changes made through this process (revoking a key, disabling or deleting a user) drop the
  affected entries at once, and again when the change commits (:meth:`invalidate_user` with the
  changing session): a lookup that raced with the change and read the old row is discarded too
  (see ``epoch``). Other replicas see such a change when their entry expires, within ``ttl``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import GatewayError
from service.schemas.common import Principal


@dataclass(slots=True)
class CachedPrincipal:
    """One authenticated key: who it belongs to and when its use was last recorded."""

    principal: Principal
    last_used_at: datetime | None
    expires_at: float = 0.0  # monotonic seconds


@dataclass(slots=True, frozen=True)
class CachedRefusal:
    """One refused key: the error it got (rebuilt for each answer) and until when it is remembered."""

    error_type: type[GatewayError]
    message: str
    code: str | None
    headers: dict[str, str] | None
    expires_at: float

    def error(self) -> GatewayError:
        # a fresh exception each time: a raised instance collects the traceback of every raise
        headers = dict(self.headers) if self.headers is not None else None
        return self.error_type(self.message, code=self.code, headers=headers)

    @property
    def liftable(self) -> bool:
        """A 403 (disabled or deleted user) may be lifted by an admin; 401s (unknown, revoked) are final."""
        return self.error_type.status_code == 403


class AuthCache:
    def __init__(
        self,
        ttl: float,
        max_entries: int = 10_000,
        *,
        refusal_ttl: float = 0.0,
        refusal_max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl < 0 or refusal_ttl < 0:
            raise ValueError("ttl must not be negative")
        if max_entries <= 0 or refusal_max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.ttl = ttl
        self.max_entries = max_entries
        self.refusal_ttl = refusal_ttl
        self.refusal_max_entries = refusal_max_entries
        self._clock = clock
        self._entries: OrderedDict[str, CachedPrincipal] = OrderedDict()
        self._refusals: OrderedDict[str, CachedRefusal] = OrderedDict()
        self._epoch = 0
        self.hits = 0
        self.misses = 0
        self.refusal_hits = 0

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    @property
    def epoch(self) -> int:
        """Changes on every invalidation; read it before a database lookup and pass it to :meth:`put`."""
        return self._epoch

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key_hash: object) -> bool:
        return key_hash in self._entries

    def get(self, key_hash: str) -> CachedPrincipal | None:
        """The entry for ``key_hash`` unless missing or expired."""
        entry = self._entries.get(key_hash)
        if entry is None:
            self.misses += 1
            return None
        if self._clock() >= entry.expires_at:
            del self._entries[key_hash]
            self.misses += 1
            return None
        self._entries.move_to_end(key_hash)
        self.hits += 1
        return entry

    def put(self, key_hash: str, entry: CachedPrincipal, *, epoch: int) -> bool:
        """Store ``entry`` unless an invalidation happened since ``epoch`` was read; True when stored."""
        if not self.enabled or epoch != self._epoch:
            return False
        entry.expires_at = self._clock() + self.ttl
        self._entries[key_hash] = entry
        self._entries.move_to_end(key_hash)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return True

    def refusal(self, key_hash: str) -> GatewayError | None:
        """The error a refused key got, if it was refused less than ``refusal_ttl`` seconds ago."""
        entry = self._refusals.get(key_hash)
        if entry is None:
            return None
        if self._clock() >= entry.expires_at:
            del self._refusals[key_hash]
            return None
        self._refusals.move_to_end(key_hash)
        self.refusal_hits += 1
        return entry.error()

    def put_refusal(self, key_hash: str, error: GatewayError, *, epoch: int) -> bool:
        """Remember that ``key_hash`` was refused with ``error`` (unless an invalidation happened
        since ``epoch`` was read, e.g. the user was enabled again meanwhile); True when stored."""
        if self.refusal_ttl <= 0 or epoch != self._epoch:
            return False
        self._refusals[key_hash] = CachedRefusal(
            type(error), error.message, error.code, error.headers, self._clock() + self.refusal_ttl
        )
        self._refusals.move_to_end(key_hash)
        while len(self._refusals) > self.refusal_max_entries:
            self._refusals.popitem(last=False)
        return True

    @property
    def refusals(self) -> int:
        """How many refused keys are remembered now (expired ones included until they are looked up)."""
        return len(self._refusals)

    def _drop(self, predicate: Callable[[Principal], bool]) -> None:
        self._epoch += 1
        for key_hash in [h for h, e in self._entries.items() if predicate(e.principal)]:
            del self._entries[key_hash]
        self._drop_liftable_refusals()

    def _drop_liftable_refusals(self) -> None:
        # a refusal is not tied to a user id (an unknown key has none): every user change drops the
        # 403s, which are few, so an enabled user is served at once; 401s cannot be lifted
        for key_hash in [h for h, r in self._refusals.items() if r.liftable]:
            del self._refusals[key_hash]

    def _again_on_commit(self, session: AsyncSession | None, drop: Callable[[], None]) -> None:
        if session is not None:
            event.listen(session.sync_session, "after_commit", lambda _: drop(), once=True)

    def invalidate_user(self, user_id: int, session: AsyncSession | None = None) -> None:
        """Forget every key of ``user_id`` now and, given the changing ``session``, when it commits."""
        drop = lambda: self._drop(lambda p: p.user_id == user_id)  # noqa: E731
        drop()
        self._again_on_commit(session, drop)

    def invalidate_key(self, api_key_id: int, session: AsyncSession | None = None) -> None:
        """Forget the key with id ``api_key_id`` now and, given the changing ``session``, when it commits."""
        drop = lambda: self._drop(lambda p: p.api_key_id == api_key_id)  # noqa: E731
        drop()
        self._again_on_commit(session, drop)

    def invalidate_all(self, session: AsyncSession | None = None) -> None:
        """Forget every entry now and, given the changing ``session``, when it commits (e.g. after
        users received message IDs of a new length, which cached principals lack)."""
        self.clear()
        self._again_on_commit(session, self.clear)

    def clear(self) -> None:
        self._epoch += 1
        self._entries.clear()
        self._drop_liftable_refusals()
