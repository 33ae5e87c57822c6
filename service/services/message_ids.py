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
    added: dict[MessageLength, int] = {}
    for params in lengths:

        async def batch(p: WatermarkParams = params) -> BatchResult:
            async with session_scope(sessionmaker) as session:
                result = await MessageIdService(Repositories(session)).fill_batch(p, limit=batch_size)
                if result.inserted and result.first_missing is not None and result.last_missing is not None:
                    span = (result.first_missing, result.last_missing)
                    await audit.record(session, message_ids_allocated(p, result.inserted, span))
                return result

        try:
            added[length_of(params)] = await _until_done(params, batch)
        except ConflictError as exc:
            logger.error(
                "message IDs could not be allocated for a key version's message length",
                extra={"bits": params.bits, "block_bits": params.block_bits, "code": exc.code},
            )
    return added
