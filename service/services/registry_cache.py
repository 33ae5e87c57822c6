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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

import numpy as np
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.parties import end_user_of
from service.repositories.registry import RegistryEntry, RegistryFingerprint, RegistryRepository
from xmark_core import CandidateSet, WatermarkParams, bits_to_blocks

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


class Owners(Mapping[int, RegisteredUser]):
    """Who holds each registered ID of one length, by holder number (``service.parties``): the
    accounts in a mapping (a few per 10^3 end users), their end users packed in arrays sorted by
    end-user id (id, account, identifier as UTF-8 in one buffer). With them a snapshot of 10^7 end
    users' IDs holds 188 bytes per ID, where a ``RegisteredUser`` per holder made it 660
    (``benchmarks/registry_memory.py``). End users added by a refresh wait in a small mapping until
    ``REPACK_AT`` of them are packed in.

    An end user's account name and status are its account's as this snapshot last read them
    (``update_account``), like the account's own."""

    REPACK_AT = 65_536

    def __init__(self) -> None:
        self._accounts: dict[int, tuple[str, str]] = {}  # every account seen: (name, status)
        self._holding: set[int] = set()  # accounts that hold an ID of this length themselves
        # end users in the order they were packed: account, and identifier i as
        # text[offsets[i]:offsets[i + 1]]; found through their ids in ascending order and, for each,
        # its place in that order
        self._accounts_of = np.zeros(0, dtype=np.int64)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._text = b""
        self._sorted_ids = np.zeros(0, dtype=np.int64)
        self._places = np.zeros(0, dtype=np.int64)
        self._recent: dict[int, tuple[int, str]] = {}  # end-user id -> (account, identifier)
        # merged slots (few: a first sight that lost a race across replicas) -> the end user they name
        self._merged: dict[int, int] = {}
        # slices of a load not packed yet (``add_slice``): ids, accounts, identifiers' lengths, text
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, bytes]] = []

    @classmethod
    def of(cls, entries: Sequence[RegistryEntry]) -> Owners:
        owners = cls()
        owners.add_slice(entries)
        owners.pack()
        return owners

    def add_slice(self, entries: Sequence[RegistryEntry]) -> None:
        """Hold the holders of one slice of a load (each holder once in the whole load: one ID of a
        length each), packed as arrays at once; they are found once ``pack`` has run."""
        end_users = []
        for entry in entries:
            self._accounts[entry.user_id] = (entry.name, entry.status)
            if entry.end_user_id is None:
                self._holding.add(entry.user_id)
            else:
                end_users.append(entry)
                if entry.merged_into is not None:
                    self._merged[entry.end_user_id] = entry.merged_into
        if not end_users:
            return
        count = len(end_users)
        texts = [(e.identifier or "").encode() for e in end_users]
        self._pending.append(
            (
                np.fromiter((e.end_user_id for e in end_users), dtype=np.int64, count=count),
                np.fromiter((e.user_id for e in end_users), dtype=np.int64, count=count),
                np.fromiter((len(t) for t in texts), dtype=np.int64, count=count),
                b"".join(texts),
            )
        )

    def add(self, entries: Iterable[RegistryEntry]) -> None:
        """Hold these entries' holders too (an entry whose holder is held already changes nothing
        but its account's name and status)."""
        for entry in entries:
            self._accounts[entry.user_id] = (entry.name, entry.status)
            if entry.end_user_id is None:
                self._holding.add(entry.user_id)
            elif -entry.end_user_id not in self:
                self._recent[entry.end_user_id] = (entry.user_id, entry.identifier or "")
                if entry.merged_into is not None:
                    self._merged[entry.end_user_id] = entry.merged_into
        if len(self._recent) >= self.REPACK_AT:
            self.pack()

    def update_account(self, user_id: int, name: str, status: str) -> None:
        if user_id in self._accounts:
            self._accounts[user_id] = (name, status)

    def pack(self) -> None:
        """Append the end users added since the last pack to the arrays (and sort their ids in)."""
        if self._recent:
            count = len(self._recent)
            texts = [identifier.encode() for _, identifier in self._recent.values()]
            self._pending.append(
                (
                    np.fromiter(self._recent, dtype=np.int64, count=count),
                    np.fromiter((a for a, _ in self._recent.values()), dtype=np.int64, count=count),
                    np.fromiter((len(t) for t in texts), dtype=np.int64, count=count),
                    b"".join(texts),
                )
            )
            self._recent = {}
        if not self._pending:
            return
        ids = np.concatenate([p[0] for p in self._pending])
        lengths = np.concatenate([p[2] for p in self._pending])
        places = np.arange(len(self._accounts_of), len(self._accounts_of) + len(ids), dtype=np.int64)
        self._accounts_of = np.concatenate([self._accounts_of, *(p[1] for p in self._pending)])
        self._offsets = np.concatenate([self._offsets, self._offsets[-1] + np.cumsum(lengths)])
        self._text = b"".join([self._text, *(p[3] for p in self._pending)])
        self._pending = []
        all_ids = np.concatenate([self._sorted_ids, ids])
        order = np.argsort(all_ids, kind="stable")
        self._sorted_ids = all_ids[order]
        self._places = np.concatenate([self._places, places])[order]

    def _end_user(self, end_user_id: int) -> tuple[int, str] | None:
        recent = self._recent.get(end_user_id)
        if recent is not None:
            return recent
        i = int(np.searchsorted(self._sorted_ids, end_user_id))
        if i == len(self._sorted_ids) or int(self._sorted_ids[i]) != end_user_id:
            return None
        place = int(self._places[i])
        start, end = int(self._offsets[place]), int(self._offsets[place + 1])
        return int(self._accounts_of[place]), self._text[start:end].decode()

    def __getitem__(self, key: int) -> RegisteredUser:
        end_user_id = end_user_of(key)
        if end_user_id is None:
            if key not in self._holding:
                raise KeyError(key)
            name, status = self._accounts[key]
            return RegisteredUser(key, name, status)
        found = self._end_user(end_user_id)
        if found is None:
            raise KeyError(key)
        account, identifier = found
        name, status = self._accounts[account]
        return RegisteredUser(account, name, status, self._merged.get(end_user_id, end_user_id), identifier)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        end_user_id = end_user_of(key)
        return key in self._holding if end_user_id is None else self._end_user(end_user_id) is not None

    def __iter__(self) -> Iterator[int]:
        yield from self._holding
        for end_user_id in self._sorted_ids.tolist():
            yield -end_user_id
        for end_user_id in self._recent:
            yield -end_user_id

    def __len__(self) -> int:
        return len(self._holding) + len(self._sorted_ids) + len(self._recent)


class SnapshotBuilder:
    """Builds the snapshot of one length slice by slice (``RegistryRepository.slices``): each slice's
    IDs are packed into blocks and its holders into ``Owners`` as it comes, so a load holds the
    snapshot and one slice of rows, not every row at once."""

    def __init__(self, params: WatermarkParams) -> None:
        self.params = params
        self._blocks: list[np.ndarray] = []
        self._ids: list[int] = []
        self._owners = Owners()
        self._skipped = 0

    def add(self, entries: Sequence[RegistryEntry]) -> None:
        kept = [entry for entry in entries if _well_formed(entry.message_id, self.params)]
        self._skipped += len(entries) - len(kept)
        if not kept:
            return
        self._blocks.append(bits_to_blocks([e.message_id for e in kept], self.params).astype(np.uint8))
        self._ids.extend(e.key for e in kept)
        self._owners.add_slice(kept)

    def finish(self, fingerprint: RegistryFingerprint | None = None) -> RegistrySnapshot:
        if self._skipped:
            logger.warning("malformed message IDs are not attributable", extra={"count": self._skipped})
        self._owners.pack()
        blocks = np.concatenate(self._blocks) if self._blocks else np.zeros((0, self.params.num_blocks), dtype=np.uint8)
        return RegistrySnapshot(CandidateSet.from_blocks(blocks, self._ids, self.params), self._owners, fingerprint)


def build_snapshot(
    entries: Sequence[RegistryEntry], params: WatermarkParams, fingerprint: RegistryFingerprint | None = None
) -> RegistrySnapshot:
    """The snapshot of every registered ID of one length (``entries``, as the registry reads them);
    a malformed ID is left out (logged)."""
    builder = SnapshotBuilder(params)
    builder.add(entries)
    return builder.finish(fingerprint)


@dataclass(frozen=True)
class RegistrySnapshot:
    """Every registered message ID of one length, packed for scoring, and who owns it."""

    candidates: CandidateSet
    # by the holder's number in the registry (``service.parties``: accounts' and end users'); the
    # cache's snapshots hold ``Owners``
    users: Mapping[int, RegisteredUser] = field(repr=False)
    fingerprint: RegistryFingerprint | None = None

    def __len__(self) -> int:
        return len(self.candidates)

    @functools.cached_property
    def _positions(self) -> tuple[np.ndarray, np.ndarray]:
        """The holders' numbers in ascending order and each one's position in ``candidates`` (built
        once per snapshot, on first use): 16 bytes per ID, where a dict took about 100."""
        ids = self.candidates.ids
        keys = np.fromiter((int(k) for k in ids), dtype=np.int64, count=len(ids))  # type: ignore[call-overload]
        order = np.argsort(keys, kind="stable")
        return keys[order], order

    def restricted(self, user_ids: Sequence[int]) -> RegistrySnapshot:
        """The snapshot of ``user_ids`` alone (in that order; users without an ID of this length
        are left out): the candidates a content search led to."""
        keys, order = self._positions
        wanted = np.fromiter(dict.fromkeys(int(u) for u in user_ids), dtype=np.int64)
        positions: list[int] = []
        if len(keys) and len(wanted):
            at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
            positions = order[at[keys[at] == wanted]].tolist()
        kept = [key for key in (self.candidates.ids[i] for i in positions) if isinstance(key, int)]
        return RegistrySnapshot(self.candidates.subset(positions), {u: self.users[u] for u in kept if u in self.users})


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
        builder = SnapshotBuilder(params)
        async for piece in repo.slices(params.bits, params.block_bits):
            builder.add(piece)
        self.reloads += 1
        return builder.finish(fingerprint)

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
        if not isinstance(known, Owners):  # a snapshot the cache did not build: reload it
            return None
        new = [e for e in added if e.key not in known and _well_formed(e.message_id, params)]
        changed = (
            await repo.users_updated_since(seen.max_updated_at - TIME_WINDOW) if seen.max_updated_at is not None else []
        )
        # users already registered keep their packed ID (IDs never change); names and statuses are
        # updated in place (an account's end users' with it), so a snapshot in use by a request
        # reads the newer values at worst
        for user_id, name, status in changed:
            known.update_account(user_id, name, status)
        known.add(new)
        candidates = current.candidates.extended([e.message_id for e in new], [e.key for e in new])
        self.refreshes += 1
        return RegistrySnapshot(candidates, known, now)


_Newest = TypeVar("_Newest", int, datetime)


def _decreased(old: _Newest | None, new: _Newest | None) -> bool:
    return old is not None and (new is None or new < old)


def _well_formed(message_id: str, params: WatermarkParams) -> bool:
    return len(message_id) == params.bits and not set(message_id) - {"0", "1"}
