"""The identifiers an account's end users have, known to this process: a first sight of an
identifier surely new takes a slot without reading the database.

A request naming an identifier this process has not cached must learn whether the account already
has that end user: one read (``EndUserDirectory._probe``). For the accounts that have first sights
here (those holding slots, ``service.end_users.reserve``), ``KnownIdentifiers`` holds a 64-bit hash
of each of the account's identifiers (deleted end users' included): loaded once in the background
(one statement, the account's identifiers), then kept current with this process's own first sights
at once and with the other replicas' by a read of the end users created since the last one, at most
every ``refresh_s`` seconds (``ix_end_users_user_id_created_at``; ``OVERLAP`` behind it, for
transactions that commit late and clocks that differ between replicas). An identifier whose hash is
absent from knowledge refreshed within ``refresh_s`` is surely new, but for an end user another
replica created since: that first sight's claim then finds it and merges the slot into it
(``end_user.merge``), so its texts still name it; it costs one message ID. Anything else (a hash
present, knowledge stale or not loaded) goes through the read.

Knowledge is kept for accounts of at most ``MAX_PER_ACCOUNT`` end users and ``MAX_TOTAL``
identifiers in all per process (8 bytes each in sorted arrays, plus the ones added since a load).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import session_scope
from service.models import EndUser

logger = logging.getLogger("xmark.end_users")

MAX_PER_ACCOUNT = 100_000
MAX_TOTAL = 1_000_000
# how far behind the last read's start the next one reads again
OVERLAP = timedelta(seconds=60)


def identifier_hash(identifier: str) -> int:
    return int.from_bytes(hashlib.blake2b(identifier.encode(), digest_size=8).digest(), "little")


def _sorted_digests(identifiers: list[str]) -> np.ndarray:
    digests = np.fromiter((identifier_hash(i) for i in identifiers), dtype=np.uint64, count=len(identifiers))
    return np.unique(digests)


def _in_sorted(values: np.ndarray, digest: int) -> bool:
    i = int(np.searchsorted(values, np.uint64(digest)))
    return i < len(values) and int(values[i]) == digest


@dataclass(slots=True)
class _Account:
    loaded: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))  # sorted
    added: set[int] = field(default_factory=set)
    # when the last read started (monotonic; None: never loaded) and its cut-off for the next one
    fresh_at: float | None = None
    since: datetime | None = None
    reading: asyncio.Task[None] | None = None
    too_large: bool = False

    def __contains__(self, digest: int) -> bool:
        return digest in self.added or _in_sorted(self.loaded, digest)

    def __len__(self) -> int:
        return len(self.loaded) + len(self.added)


class KnownIdentifiers:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        refresh_s: float,
        max_per_account: int = MAX_PER_ACCOUNT,
        max_total: int = MAX_TOTAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.refresh_s = refresh_s
        self.max_per_account = max_per_account
        self.max_total = max_total
        self._clock = clock
        self._accounts: dict[int, _Account] = {}
        self._total = 0

    def surely_new(self, user_id: int, identifier: str) -> bool:
        """True when the account's identifiers are known as of at most ``refresh_s`` ago and
        ``identifier`` is not among them; a read starts when the knowledge is missing or stale."""
        account = self._accounts.get(user_id)
        if account is None or account.too_large:
            return False
        fresh = account.fresh_at is not None and self._clock() - account.fresh_at < self.refresh_s
        if not fresh:
            self._read(user_id, account)
            return False
        return identifier_hash(identifier) not in account

    def want(self, user_id: int) -> None:
        """Keep the account's identifiers (it has first sights in this process)."""
        account = self._accounts.get(user_id)
        if account is None:
            if self._total >= self.max_total or self.refresh_s <= 0:
                return
            account = self._accounts[user_id] = _Account()
        if account.fresh_at is None or self._clock() - account.fresh_at >= self.refresh_s:
            self._read(user_id, account)

    def add(self, user_id: int, identifier: str) -> None:
        """The account has an end user ``identifier`` now (a first sight in this process)."""
        account = self._accounts.get(user_id)
        if account is not None and not account.too_large:
            self._add(account, [identifier_hash(identifier)])

    def _add(self, account: _Account, digests: Iterable[int]) -> None:
        before = len(account.added)
        account.added.update(d for d in digests if d not in account)
        self._total += len(account.added) - before
        if len(account) > self.max_per_account or self._total > self.max_total:
            self._drop(account)

    def _drop(self, account: _Account) -> None:
        self._total -= len(account)
        account.loaded = np.empty(0, dtype=np.uint64)
        account.added = set()
        account.too_large = True

    def reading(self, user_id: int) -> asyncio.Task[None] | None:
        account = self._accounts.get(user_id)
        return None if account is None else account.reading

    def _read(self, user_id: int, account: _Account) -> None:
        if account.reading is None or account.reading.done():
            account.reading = asyncio.create_task(self._refresh(user_id, account))

    async def _refresh(self, user_id: int, account: _Account) -> None:
        started, now = self._clock(), datetime.now(UTC)
        try:
            async with session_scope(self._sessionmaker) as session:
                if account.since is None:
                    count = await session.scalar(
                        select(func.count()).select_from(EndUser).where(EndUser.user_id == user_id)
                    )
                    if int(count or 0) > self.max_per_account:
                        self._drop(account)
                        return
                stmt = select(EndUser.identifier).where(EndUser.user_id == user_id, EndUser.identifier.is_not(None))
                if account.since is not None:
                    stmt = stmt.where(EndUser.created_at >= account.since)
                identifiers = [i for i in (await session.scalars(stmt)).all() if i is not None]
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            logger.warning(
                "an account's end-user identifiers were not read; its first sights read the database",
                extra={"user_id": user_id, "error": type(exc).__name__},
            )
            return
        if account.since is None:
            # a whole account's identifiers (up to ``max_per_account``) are hashed and sorted in a
            # worker thread, not on the event loop
            loaded = await asyncio.to_thread(_sorted_digests, identifiers)
            self._total += len(loaded)
            account.loaded = loaded
            # this process's own additions meanwhile (not committed when the read ran, perhaps)
            kept = {d for d in account.added if not _in_sorted(loaded, d)}
            self._total -= len(account.added) - len(kept)
            account.added = kept
            if len(account) > self.max_per_account or self._total > self.max_total:
                self._drop(account)
        else:
            self._add(account, [identifier_hash(i) for i in identifiers])
        if account.too_large:
            return
        account.since = now - OVERLAP
        account.fresh_at = started

    async def aclose(self) -> None:
        reads = [a.reading for a in self._accounts.values() if a.reading is not None and not a.reading.done()]
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
