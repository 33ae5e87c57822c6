"""In-memory snapshot of the message-ID registry, rebuilt only when the users table changes.

Attribution scores a decoded text against every message ID ever allocated (deleted users keep
theirs as tombstones, which stay attributable). Loading 10,000 users per request would dominate
``/trace``, so the packed ``CandidateSet`` is cached. At most every ``check_interval`` seconds a
cheap fingerprint query (row count, largest id, latest update) decides whether to reload.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
    """Every registered message ID, packed for scoring, and who owns it."""

    candidates: CandidateSet
    users: dict[int, RegisteredUser] = field(repr=False)
    fingerprint: RegistryFingerprint | None = None

    def __len__(self) -> int:
        return len(self.candidates)


class RegistryCache:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        params: WatermarkParams,
        *,
        check_interval: float = 1.0,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._params = params
        self.check_interval = check_interval
        self._snapshot: RegistrySnapshot | None = None
        self._checked_at = float("-inf")
        self._lock = asyncio.Lock()
        self.reloads = 0

    def invalidate(self) -> None:
        """Force a fingerprint check on the next lookup (e.g. after this process changed users)."""
        self._checked_at = float("-inf")

    async def snapshot(self, session: AsyncSession | None = None) -> RegistrySnapshot:
        """The current snapshot; queries the database at most every ``check_interval`` seconds.

        ``session`` (the request's own) is used for the queries when given, so a request sees
        the users its own transaction can see.
        """
        current = self._snapshot
        if current is not None and time.monotonic() - self._checked_at < self.check_interval:
            return current
        async with self._lock:
            current = self._snapshot
            if current is not None and time.monotonic() - self._checked_at < self.check_interval:
                return current
            if session is not None:
                snapshot = await self._refresh(session, current)
            else:
                async with self._sessionmaker() as own_session:
                    snapshot = await self._refresh(own_session, current)
            self._snapshot = snapshot
            self._checked_at = time.monotonic()
            return snapshot

    async def _refresh(self, session: AsyncSession, current: RegistrySnapshot | None) -> RegistrySnapshot:
        repo = RegistryRepository(session)
        fingerprint = await repo.fingerprint()
        if current is not None and current.fingerprint == fingerprint:
            return current
        entries = await repo.entries()
        bits: list[str] = []
        ids: list[int] = []
        users: dict[int, RegisteredUser] = {}
        skipped = 0
        for entry in entries:
            if len(entry.message_id) != self._params.bits or set(entry.message_id) - {"0", "1"}:
                skipped += 1
                continue
            bits.append(entry.message_id)
            ids.append(entry.user_id)
            users[entry.user_id] = RegisteredUser(entry.user_id, entry.name, entry.status)
        if skipped:
            logger.warning("message IDs of another length are not attributable", extra={"count": skipped})
        self.reloads += 1
        return RegistrySnapshot(CandidateSet(bits, ids, self._params), users, fingerprint)
