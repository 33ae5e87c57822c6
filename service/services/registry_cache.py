"""In-memory snapshots of the message-ID registry, one per message length, rebuilt only when the
registry changes.

Attribution scores a decoded text against every message ID ever allocated (deleted users keep
theirs as tombstones, which stay attributable). Key versions of different message lengths
(bits, block_bits) coexist, and a text decoded under a version is scored against the IDs of that
version's length, so there is one snapshot per length. Loading 10,000 users per request would
dominate ``/trace``, so the packed ``CandidateSet`` of each length is cached. At most every
``check_interval`` seconds a cheap fingerprint query (user count, largest id, latest update, and the
count and largest row id of the length's IDs) decides whether to reload it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.repositories.registry import RegistryFingerprint, RegistryRepository
from xmark_core import CandidateSet, WatermarkParams

logger = logging.getLogger("xmark.registry")


@dataclass(frozen=True)
class RegisteredUser:
    user_id: int
    name: str
    status: str


@dataclass(frozen=True)
class RegistrySnapshot:
    """Every registered message ID of one length, packed for scoring, and who owns it."""

    candidates: CandidateSet
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
        self.reloads = 0

    def invalidate(self) -> None:
        """Force a fingerprint check on the next lookup (e.g. after this process changed users)."""
        for cached in self._cached.values():
            cached.checked_at = float("-inf")

    def _fresh(self, length: tuple[int, int]) -> RegistrySnapshot | None:
        cached = self._cached.get(length)
        if cached is not None and time.monotonic() - cached.checked_at < self.check_interval:
            return cached.snapshot
        return None

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
        fingerprint = await repo.fingerprint(params.bits, params.block_bits)
        if current is not None and current.fingerprint == fingerprint:
            return current
        entries = await repo.entries(params.bits, params.block_bits)
        bits: list[str] = []
        ids: list[int] = []
        users: dict[int, RegisteredUser] = {}
        skipped = 0
        for entry in entries:
            if len(entry.message_id) != params.bits or set(entry.message_id) - {"0", "1"}:
                skipped += 1
                continue
            bits.append(entry.message_id)
            ids.append(entry.user_id)
            users[entry.user_id] = RegisteredUser(entry.user_id, entry.name, entry.status)
        if skipped:
            logger.warning("malformed message IDs are not attributable", extra={"count": skipped})
        self.reloads += 1
        return RegistrySnapshot(CandidateSet(bits, ids, params), users, fingerprint)
