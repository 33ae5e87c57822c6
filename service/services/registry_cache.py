"""In-memory snapshots of the message-ID registry, one per message length, rebuilt only when the
registry changes.

Attribution scores a decoded text against every message ID ever allocated (deleted users keep
theirs as tombstones, which stay attributable). Key versions of different message lengths
(bits, block_bits) coexist, and a text decoded under a version is scored against the IDs of that
version's length, so there is one snapshot per length. Loading 10,000 users per request would
dominate ``/trace``, so the packed ``CandidateSet`` of each length is cached. At most every
``check_interval`` seconds a cheap fingerprint query (user count, largest id, latest update, and the
count and largest row id of the length's IDs) decides whether to reload it.

A registry of ``INCREMENTAL_FROM`` IDs or more (a provider's millions of users) is never reloaded
whole on a change: the check reads three index entries (no counts), and a change reads only the ID
rows after the newest one seen and the users changed since the latest change seen, each with a
window behind it (``ROW_WINDOW`` rows, ``TIME_WINDOW``) for transactions that commit out of order.
Loading 10^6 IDs takes seconds; a change then costs milliseconds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.repositories.registry import RegistryEntry, RegistryFingerprint, RegistryRepository
from xmark_core import CandidateSet, WatermarkParams

logger = logging.getLogger("xmark.registry")

# registries of at least this many IDs are refreshed by what changed, not reloaded
INCREMENTAL_FROM = 50_000
# re-read behind the newest ID row and the latest change seen: rows that commit out of order
ROW_WINDOW = 10_000
TIME_WINDOW = timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class RegisteredUser:
    """A holder of message IDs: an account, or (``end_user_id`` set) one of its end users, named
    by the account's id, name and status and the end user's id and identifier."""

    user_id: int
    name: str
    status: str
    end_user_id: int | None = None
    identifier: str | None = None


def _registered(entry: RegistryEntry) -> RegisteredUser:
    return RegisteredUser(entry.user_id, entry.name, entry.status, entry.end_user_id, entry.identifier)


def build_snapshot(
    entries: Sequence[RegistryEntry], params: WatermarkParams, fingerprint: RegistryFingerprint | None = None
) -> RegistrySnapshot:
    """The snapshot of every registered ID of one length (``entries``, as the registry reads them);
    a malformed ID is left out (logged)."""
    bits: list[str] = []
    ids: list[int] = []
    users: dict[int, RegisteredUser] = {}
    # an account's name and status once, not once per row of its end users (the driver returns a
    # string of its own per row: 110 bytes per ID at 10^7 end users)
    shared: dict[str, str] = {}
    skipped = 0
    for entry in entries:
        if not _well_formed(entry.message_id, params):
            skipped += 1
            continue
        key = entry.key  # one int object for the list and the mapping
        bits.append(entry.message_id)
        ids.append(key)
        name = shared.setdefault(entry.name, entry.name)
        status = shared.setdefault(entry.status, entry.status)
        users[key] = RegisteredUser(entry.user_id, name, status, entry.end_user_id, entry.identifier)
    if skipped:
        logger.warning("malformed message IDs are not attributable", extra={"count": skipped})
    return RegistrySnapshot(CandidateSet(bits, ids, params), users, fingerprint)


@dataclass(frozen=True)
class RegistrySnapshot:
    """Every registered message ID of one length, packed for scoring, and who owns it."""

    candidates: CandidateSet
    # by the holder's number in the registry (``service.parties``: accounts' and end users')
    users: dict[int, RegisteredUser] = field(repr=False)
    fingerprint: RegistryFingerprint | None = None

    def __len__(self) -> int:
        return len(self.candidates)

    @functools.cached_property
    def _index_of(self) -> dict[int, int]:
        """Each user's position in ``candidates`` (built once per snapshot, on first use)."""
        return {int(user_id): i for i, user_id in enumerate(self.candidates.ids)}  # type: ignore[call-overload]

    def restricted(self, user_ids: Sequence[int]) -> RegistrySnapshot:
        """The snapshot of ``user_ids`` alone (in that order; users without an ID of this length
        are left out): the candidates a content search led to."""
        index = self._index_of
        positions = [index[u] for u in dict.fromkeys(user_ids) if u in index]
        kept = {self.candidates.ids[i] for i in positions}
        return RegistrySnapshot(
            self.candidates.subset(positions), {u: user for u, user in self.users.items() if u in kept}, None
        )


@dataclass
class _Cached:
    snapshot: RegistrySnapshot
    checked_at: float


class RegistryCache:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        check_interval: float = 1.0,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.check_interval = check_interval
        self._cached: dict[tuple[int, int], _Cached] = {}
        self._lock = asyncio.Lock()
        self.reloads = 0  # whole loads of a length's IDs
        self.refreshes = 0  # changes read into a large registry's snapshot without a reload

    def invalidate(self) -> None:
        """Force a fingerprint check on the next lookup (e.g. after this process changed users)."""
        for cached in self._cached.values():
            cached.checked_at = float("-inf")

    def _fresh(self, length: tuple[int, int]) -> RegistrySnapshot | None:
        cached = self._cached.get(length)
        if cached is not None and time.monotonic() - cached.checked_at < self.check_interval:
            return cached.snapshot
        return None

    async def warm(self, lengths: Sequence[WatermarkParams]) -> None:
        """Load the snapshots of ``lengths`` (at start-up, off the request path: 10^6 IDs take
        seconds); a failure is logged and the first trace of the length loads it instead."""
        started = time.perf_counter()
        loaded = 0
        for params in lengths:
            try:
                loaded += len(await self.snapshot(params))
            except Exception as exc:
                logger.warning("trace registry not preloaded", extra={"error_type": type(exc).__name__})
                return
        logger.info(
            "trace registry loaded", extra={"message_ids": loaded, "seconds": round(time.perf_counter() - started, 2)}
        )

    async def snapshot(self, params: WatermarkParams, session: AsyncSession | None = None) -> RegistrySnapshot:
        """The current snapshot of ``params``' message length (bits, block_bits); queries the
        database at most every ``check_interval`` seconds per length.

        ``session`` (the request's own) is used for the queries when given, so a request sees
        the users its own transaction can see.
        """
        length = (params.bits, params.block_bits)
        fresh = self._fresh(length)
        if fresh is not None:
            return fresh
        async with self._lock:
            fresh = self._fresh(length)
            if fresh is not None:
                return fresh
            cached = self._cached.get(length)
            current = cached.snapshot if cached is not None else None
            if session is not None:
                snapshot = await self._refresh(session, params, current)
            else:
                async with self._sessionmaker() as own_session:
                    snapshot = await self._refresh(own_session, params, current)
            self._cached[length] = _Cached(snapshot, time.monotonic())
            return snapshot

    async def _refresh(
        self, session: AsyncSession, params: WatermarkParams, current: RegistrySnapshot | None
    ) -> RegistrySnapshot:
        repo = RegistryRepository(session)
        large = current is not None and len(current) >= INCREMENTAL_FROM
        fingerprint = await repo.fingerprint(params.bits, params.block_bits, counts=not large)
        if current is not None and current.fingerprint is not None and current.fingerprint.same_as(fingerprint):
            return current
        if large and current is not None and current.fingerprint is not None:
            grown = await self._grow(repo, params, current, current.fingerprint, fingerprint)
            if grown is not None:
                return grown
        entries = await repo.entries(params.bits, params.block_bits)
        self.reloads += 1
        return build_snapshot(entries, params, fingerprint)

    async def _grow(
        self,
        repo: RegistryRepository,
        params: WatermarkParams,
        current: RegistrySnapshot,
        seen: RegistryFingerprint,
        now: RegistryFingerprint,
    ) -> RegistrySnapshot | None:
        """``current`` with the IDs and user changes since ``seen``; None when the registry did not
        only grow or change (a newest value went back: rows rolled back), which a reload handles."""
        went_back = (
            _decreased(seen.max_id, now.max_id)
            or _decreased(seen.max_updated_at, now.max_updated_at)
            or _decreased(seen.max_message_id_row, now.max_message_id_row)
        )
        if went_back:
            return None
        after = (seen.max_message_id_row or 0) - ROW_WINDOW
        added = [e for _, e in await repo.entries_after(params.bits, params.block_bits, after)]
        known = current.users
        new = [e for e in added if e.key not in known and _well_formed(e.message_id, params)]
        changed = (
            await repo.users_updated_since(seen.max_updated_at - TIME_WINDOW) if seen.max_updated_at is not None else []
        )
        # users already registered keep their packed ID (IDs never change); names and statuses are
        # updated in place, so a snapshot in use by a request reads the newer values at worst
        # (an end user keeps its account's name and status as they were when its ID was read)
        for user_id, name, status in changed:
            if user_id in known:
                known[user_id] = RegisteredUser(user_id, name, status)
        for entry in new:
            known[entry.key] = _registered(entry)
        candidates = current.candidates.extended([e.message_id for e in new], [e.key for e in new])
        self.refreshes += 1
        return RegistrySnapshot(candidates, known, now)


_Newest = TypeVar("_Newest", int, datetime)


def _decreased(old: _Newest | None, new: _Newest | None) -> bool:
    return old is not None and (new is None or new < old)


def _well_formed(message_id: str, params: WatermarkParams) -> bool:
    return len(message_id) == params.bits and not set(message_id) - {"0", "1"}
