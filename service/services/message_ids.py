"""Message IDs per message length: which lengths are in use, and an ID of a length for every user.

Key versions carry their own watermark parameters, so versions of different message lengths
(bits, block_bits) coexist: 16-bit versions of an older deployment keep tracing while new versions
use the configured length. A user holds one message ID per *length in use*: the lengths of the
non-retired key versions plus the configured one (``XMARK_WATERMARK_BITS`` /
``XMARK_WATERMARK_BLOCK_BITS``, the length of new versions). New users get all of them at creation
(``services/users.py``). When a key version of a length some users have no ID of becomes usable
(registered at start-up, or activated), :func:`backfill_message_ids` / :meth:`MessageIdService.fill`
give every user one, deleted users included: IDs are never reused, and a deleted user's texts stay
attributable under every version.

Every ID is chosen by ``xmark_core``'s allocator against every ID of its length ever allocated, so
IDs of one length stay unique and far apart in Hamming distance. The backfill is idempotent and
safe when replicas race: it works in batches of users that have no ID of the length, inserts with
``ON CONFLICT DO NOTHING`` under the unique constraints on (user, length) and (length, ID), and
reads again until no user is missing one. A user whose ``users.message_id`` (the ID it was created
with) has the length's bit count keeps that ID when no one else holds it.

End users (``service/end_users``) share each length's ID space. They get the lengths in use at
first sight; :func:`backfill_end_user_message_ids` gives the existing ones an ID of a length that
became usable later, in the background (the end-user directory runs it at start-up and after an
activation), and a request of an end user it has not reached yet gets its ID on that request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import session_scope
from service.errors import ConflictError
from service.keyring import row_spec
from service.models import KeyVersion, MessageId
from service.repositories.key_versions import KeyVersionRepository
from service.repositories.message_ids import MissingUser
from service.repositories.unit import Repositories
from service.schemas.common import MessageIdOut
from service.services.audit import UNRECORDED, AuditWriter, message_ids_allocated
from service.vocabulary import KeyVersionStatus
from xmark_core import MessageAllocator, MessageSpaceExhausted, WatermarkParams
from xmark_core.encoders import KeyVersionSpec, as_spec

logger = logging.getLogger("xmark.message_ids")

MessageLength = tuple[int, int]  # (bits, block_bits)

BACKFILL_BATCH = 1000
# batches in a row that neither inserted nor saw another writer fill the missing users
MAX_STALLED_BATCHES = 5


def length_of(params: WatermarkParams) -> MessageLength:
    return (params.bits, params.block_bits)


def message_ids_out(rows: Iterable[MessageId]) -> list[MessageIdOut]:
    """A user's message IDs, shortest length first."""
    return [
        MessageIdOut(bits=row.bits, block_bits=row.block_bits, message_id=row.message_id)
        for row in sorted(rows, key=lambda r: (r.bits, r.block_bits))
    ]


@dataclass(frozen=True)
class LengthsInUse:
    """The message lengths every user needs an ID of, and the one new generations are encoded with."""

    params: tuple[WatermarkParams, ...]  # one per length; the configured primary's first
    encoding: MessageLength  # the newest active key version's length (the configured one without any)


def _newest_active(rows: Sequence[KeyVersion]) -> KeyVersion | None:
    """The newest active version (most recently activated, then created), as the keyring orders them."""
    active = [row for row in rows if row.status == KeyVersionStatus.ACTIVE]
    oldest = datetime.min.replace(tzinfo=UTC)
    return max(active, key=lambda row: (row.activated_at or oldest, row.id), default=None)


def _distinct_lengths(rows: Sequence[KeyVersion]) -> list[WatermarkParams]:
    """One parameter set per message length of the versions' encoders (a per-request version has two)."""
    found: dict[MessageLength, WatermarkParams] = {}
    for row in rows:
        for params in row_spec(row).encoders:
            found.setdefault(length_of(params), params)
    return list(found.values())


async def lengths_in_use(session: AsyncSession, configured: WatermarkParams | KeyVersionSpec) -> LengthsInUse:
    """The lengths of the non-retired key versions plus ``configured``'s (new versions' encoders,
    the primary's first)."""
    rows = await KeyVersionRepository(session).in_use()
    params: list[WatermarkParams] = []
    for p in [*as_spec(configured).encoders, *_distinct_lengths(rows)]:
        if all(length_of(p) != length_of(q) for q in params):
            params.append(p)
    newest = _newest_active(rows)
    encoding = (newest.bits, newest.block_bits) if newest is not None else length_of(as_spec(configured).primary)
    return LengthsInUse(tuple(params), encoding)


async def key_version_lengths(session: AsyncSession) -> list[WatermarkParams]:
    """One parameter set per message length of the non-retired key versions."""
    return _distinct_lengths(await KeyVersionRepository(session).in_use())


@dataclass(frozen=True)
class BatchResult:
    missing: int  # users that had no ID of the length when the batch started (0: done)
    inserted: int  # IDs this batch inserted (others may have been inserted concurrently)
    first_missing: int | None  # the lowest such user id
    last_missing: int | None = None  # the highest


def _exhausted(params: WatermarkParams) -> ConflictError:
    return ConflictError(
        f"The {params.bits}-bit message-ID space (blocks of {params.block_bits}) cannot hold an ID for "
        "every user; use a key version with longer message IDs",
        code="message_space_exhausted",
    )


def _choose(
    missing: Sequence[MissingUser], held: Sequence[str], created_with: Sequence[str], params: WatermarkParams
) -> list[tuple[int, str]]:
    """An ID of ``params``' length for each missing user (CPU work: run off the event loop)."""
    free_own = set(created_with) - set(held)
    allocator = MessageAllocator([*held, *created_with], params)
    chosen = []
    for user in missing:
        if len(user.created_with) == params.bits and user.created_with in free_own:
            chosen.append((user.user_id, user.created_with))  # the ID it was created with
            free_own.discard(user.created_with)
        else:
            chosen.append((user.user_id, allocator.allocate().bits))
    return chosen


def _allocate(count: int, taken: Sequence[str], params: WatermarkParams) -> list[str]:
    """``count`` new IDs of ``params``' length, apart from ``taken`` (CPU work: run off the event loop)."""
    allocator = MessageAllocator(taken, params)
    return [allocator.allocate().bits for _ in range(count)]


class MessageIdService:
    def __init__(self, repos: Repositories) -> None:
        self._session = repos.session
        self._repo = repos.message_ids

    async def fill_batch(self, params: WatermarkParams, *, limit: int = BACKFILL_BATCH) -> BatchResult:
        """Give up to ``limit`` users without an ID of ``params``' length one (lowest user ids first)."""
        bits, block_bits = length_of(params)
        missing = await self._repo.missing(bits, block_bits, limit=limit)
        if not missing:
            return BatchResult(0, 0, None)
        held = await self._repo.held(bits, block_bits)
        created_with = await self._repo.created_with(bits)
        try:
            chosen = await asyncio.to_thread(_choose, missing, held, created_with, params)
        except MessageSpaceExhausted:
            raise _exhausted(params) from None
        now = datetime.now(UTC)
        rows = [
            {"user_id": user_id, "bits": bits, "block_bits": block_bits, "message_id": message_id, "created_at": now}
            for user_id, message_id in chosen
        ]
        inserted = await self._repo.insert_if_free(rows)
        return BatchResult(len(missing), inserted, missing[0].user_id, missing[-1].user_id)

    async def fill_end_users_batch(self, params: WatermarkParams, *, limit: int = BACKFILL_BATCH) -> BatchResult:
        """Give up to ``limit`` end users without an ID of ``params``' length one (lowest ids first),
        chosen against every ID of the length and every ID a user was created with (a user's
        backfill may give it back that one)."""
        bits, block_bits = length_of(params)
        missing = await self._repo.missing_end_users(bits, block_bits, limit=limit)
        if not missing:
            return BatchResult(0, 0, None)
        taken = await self._repo.existing(bits, block_bits)
        try:
            chosen = await asyncio.to_thread(_allocate, len(missing), taken, params)
        except MessageSpaceExhausted:
            raise _exhausted(params) from None
        now = datetime.now(UTC)
        rows = [
            {"end_user_id": owner, "bits": bits, "block_bits": block_bits, "message_id": message_id, "created_at": now}
            for owner, message_id in zip(missing, chosen, strict=True)
        ]
        inserted = await self._repo.insert_if_free(rows)
        return BatchResult(len(missing), inserted, missing[0], missing[-1])

    async def fill_end_users_first(
        self, lengths: Sequence[WatermarkParams], *, limit: int | None = None
    ) -> tuple[int, bool]:
        """One batch per length of :meth:`fill_end_users_batch` in this unit of work (``limit``, else
        ``BACKFILL_BATCH``): how many IDs it added, and whether end users may be left without one (a
        full batch: the backfill's work)."""
        limit = BACKFILL_BATCH if limit is None else limit
        added, more = 0, False
        for params in lengths:
            result = await self.fill_end_users_batch(params, limit=limit)
            added += result.inserted
            more = more or result.missing >= limit
        return added, more

    async def fill(self, lengths: Sequence[WatermarkParams], *, batch_size: int = BACKFILL_BATCH) -> int:
        """Give every user an ID of each of ``lengths``, in this unit of work; returns how many were added."""
        total = 0
        for params in lengths:

            async def batch(p: WatermarkParams = params) -> BatchResult:
                return await self.fill_batch(p, limit=batch_size)

            total += await _until_done(params, batch)
        return total


async def _until_done(params: WatermarkParams, batch: Callable[[], Awaitable[BatchResult]]) -> int:
    """Run ``batch`` until no user lacks an ID of the length; how many IDs it inserted."""
    total = 0
    stalled = 0
    previous: tuple[int, int | None] | None = None
    while True:
        result = await batch()
        if result.missing == 0:
            break
        total += result.inserted
        state = (result.missing, result.first_missing)
        # a batch that inserted nothing made progress if another writer filled users meanwhile
        stalled = stalled + 1 if result.inserted == 0 and state == previous else 0
        previous = state
        if stalled >= MAX_STALLED_BATCHES:
            raise ConflictError(
                f"Could not allocate unique {params.bits}-bit message IDs; retry",
                code="message_id_conflict",
            )
    if total:
        logger.info(
            "message IDs allocated",
            extra={"bits": params.bits, "block_bits": params.block_bits, "count": total},
        )
    return total


async def backfill_message_ids(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    batch_size: int = BACKFILL_BATCH,
    audit: AuditWriter = UNRECORDED,
) -> dict[MessageLength, int]:
    """Start-up: give every user an ID of each length of the non-retired key versions.

    Each batch is a unit of work of its own, so a large registry is not one long transaction and
    an interrupted start resumes where it stopped; a batch that allocated IDs is recorded by
    ``audit`` in its unit of work. A length whose ID space cannot hold every user is logged and
    left (activating a version of that length is refused with 409); returns how many IDs were
    added per length.
    """
    async with session_scope(sessionmaker) as session:
        lengths = await key_version_lengths(session)
    return await _backfill(sessionmaker, lengths, batch_size=batch_size, audit=audit, end_users=False)


async def backfill_end_user_message_ids(
    sessionmaker: async_sessionmaker[AsyncSession],
    lengths: Sequence[WatermarkParams],
    *,
    batch_size: int = BACKFILL_BATCH,
    audit: AuditWriter = UNRECORDED,
    on_batch: Callable[[], None] | None = None,
) -> dict[MessageLength, int]:
    """Give every end user (deleted ones included) an ID of each of ``lengths`` it lacks, in
    batches of ``batch_size``, each a unit of work recorded by ``audit``; ``on_batch`` runs after a
    batch that added IDs has committed. Returns how many IDs were added per length."""
    return await _backfill(sessionmaker, lengths, batch_size=batch_size, audit=audit, end_users=True, on_batch=on_batch)


async def _backfill(
    sessionmaker: async_sessionmaker[AsyncSession],
    lengths: Sequence[WatermarkParams],
    *,
    batch_size: int,
    audit: AuditWriter,
    end_users: bool,
    on_batch: Callable[[], None] | None = None,
) -> dict[MessageLength, int]:
    added: dict[MessageLength, int] = {}
    for params in lengths:

        async def batch(p: WatermarkParams = params) -> BatchResult:
            async with session_scope(sessionmaker) as session:
                service = MessageIdService(Repositories(session))
                fill = service.fill_end_users_batch if end_users else service.fill_batch
                result = await fill(p, limit=batch_size)
                if result.inserted and result.first_missing is not None and result.last_missing is not None:
                    span = (result.first_missing, result.last_missing)
                    await audit.record(session, message_ids_allocated(p, result.inserted, span, end_users=end_users))
            if result.inserted and on_batch is not None:
                on_batch()
            return result

        try:
            added[length_of(params)] = await _until_done(params, batch)
        except ConflictError as exc:
            logger.error(
                "message IDs could not be allocated for a key version's message length",
                extra={"bits": params.bits, "block_bits": params.block_bits, "code": exc.code, "end_users": end_users},
            )
    return added
