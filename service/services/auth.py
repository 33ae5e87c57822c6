"""Request authentication: API key -> principal, from the per-process cache or one short database read.

A cache hit needs no database round trip. A miss reads the key, its user and the user's message
IDs in one statement on a connection of its own (never the request's unit of work; one round
trip, no transaction) and caches the result if the key was accepted. Either way a use is noted
for ``last_used_at`` once its one-minute resolution has passed, and written after the response
with the other uses of the moment (``service.services.last_use``): no request waits for it.
A refusal (401 unknown or revoked, 403 user disabled or deleted) is remembered by the key's HMAC
for a short while (``AuthCache.refusal``), so a client repeating a refused key costs no database
query either. Concurrent misses of one key share one read (a burst from one client on a cold
cache is one query, not one per request, which could take every connection of the pool and turn
the burst into 503s).

With an :class:`AuthEdge`, a key that is neither cached nor known to be valid is read only if its
client address has not spent its budget of failed authentications (``service.services.auth_edge``):
an address that sends many unknown keys gets their 401 without a database read for a while.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import read_rows
from service.errors import AuthenticationError, PermissionDeniedError
from service.repositories.api_keys import principal_rows
from service.schemas.common import Principal
from service.security import ApiKeyHasher, ParsedKey
from service.services.auth_cache import AuthCache, CachedPrincipal
from service.services.auth_edge import AuthEdge, edge_refusal
from service.services.keys import parse_bearer, principal_from_rows, touch_due
from service.services.last_use import LastUseRecorder


class Authenticator:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        hasher: ApiKeyHasher,
        cache: AuthCache,
        *,
        last_use: LastUseRecorder,
        edge: AuthEdge | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._hasher = hasher
        self.cache = cache
        # the keys' last uses, written after the responses in batches (by its owner's writer)
        self.last_use = last_use
        # the per-address budget of failed authentications (None: every miss is read)
        self.edge = edge
        self._reading: dict[str, asyncio.Task[Principal]] = {}  # key hash -> the read in progress

    async def authenticate(self, authorization: str | None, client: str | None = None) -> Principal:
        """401 for a missing, malformed, unknown or revoked key; 403 for a disabled or deleted user.

        ``client`` is the request's client address bucket (``AuthEdge.address``): a key that is
        not known to be valid is refused without a database read while that address is backed off.
        """
        return await self.authenticate_key(parse_bearer(authorization), client)

    async def authenticate_key(self, parsed: ParsedKey, client: str | None = None) -> Principal:
        """``authenticate`` for a key already read from the request's headers (whichever header
        carried it: the caches and the address budget know a key by its HMAC alone)."""
        key_hash = self._hasher.hash(parsed)
        now = datetime.now(UTC)
        entry = self.cache.get(key_hash) if self.cache.enabled else None
        if entry is None and (refused := self.cache.refusal(key_hash)) is not None:
            raise refused  # refused a moment ago: answered again without the database
        if entry is not None:
            if touch_due(entry.last_used_at, now):
                entry.last_used_at = now  # noted once a minute, not per request
                self.last_use.note(entry.principal.api_key_id, now)
            return entry.principal
        read = self._reading.get(key_hash)
        edge = self.edge
        if read is None and edge is not None and edge.enabled and client is not None:
            if not edge.known_valid(key_hash) and not await edge.allow_read(client):
                await edge.delay_refusal()
                raise edge_refusal()  # this address spent its budget: no database read
            read = self._reading.get(key_hash)  # another request may have started it meanwhile
        if read is None:
            read = asyncio.ensure_future(self._read(parsed, key_hash, now, client))
            self._reading[key_hash] = read
            read.add_done_callback(lambda done: self._finished(key_hash, done))
        # shielded: a request that leaves does not cancel the read the others wait for
        return await asyncio.shield(read)

    def _finished(self, key_hash: str, read: asyncio.Task[Principal]) -> None:
        if self._reading.get(key_hash) is read:
            del self._reading[key_hash]
        if not read.cancelled():
            read.exception()  # retrieved here too: every waiter may have left

    async def _read(self, parsed: ParsedKey, key_hash: str, now: datetime, client: str | None) -> Principal:
        """The key and its user from the database (a cache miss); the result is cached."""
        epoch = self.cache.epoch
        try:
            try:
                principal, last_used_at = principal_from_rows(
                    await read_rows(self._sessionmaker, *principal_rows(parsed.prefix)), key_hash
                )
            except (AuthenticationError, PermissionDeniedError) as exc:
                self.cache.put_refusal(key_hash, exc, epoch=epoch)
                raise
        except AuthenticationError:
            if self.edge is not None:
                await self.edge.read_done(client, key_hash, accepted=False)
            raise
        if self.edge is not None:
            await self.edge.read_done(client, key_hash, accepted=True)
        if touch_due(last_used_at, now):
            self.last_use.note(principal.api_key_id, now)
            last_used_at = now
        self.cache.put(key_hash, CachedPrincipal(principal, last_used_at), epoch=epoch)
        return principal
