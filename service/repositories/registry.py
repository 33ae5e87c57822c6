"""Read-only view of the message-ID registry: the message IDs of one length with their owners
(accounts and their end users, tombstones included)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from service.models import EndUser, MessageId, User
from service.parties import party_key
from service.vocabulary import EndUserSlot


@dataclass(frozen=True)
class RegistryEntry:
    """A message ID and its holder: an account (``end_user_id`` None) or one of its end users."""

    user_id: int  # the account (for an end user's ID, the end user's account)
    name: str  # the account's name
    status: str  # the account's status
    message_id: str
    end_user_id: int | None = None
    identifier: str | None = None  # the end user's identifier, as the platform sent it
    # a merged slot's ID (``EndUserSlot.MERGED``): the end user it names (``identifier`` is that one's);
    # the holder stays the slot row, so each ID of the registry has a holder of its own
    merged_into: int | None = None

    @property
    def key(self) -> int:
        """The holder's number in the registry (``service.parties``)."""
        return party_key(self.user_id, self.end_user_id)


@dataclass(frozen=True)
class RegistryFingerprint:
    """Cheap summary that changes whenever a user is added, changed or deleted, or gets an ID of the length.

    The newest user id, the latest ``updated_at`` and the newest message-ID row each come from an
    index (one row read each), whatever the registry's size. The counts, which must read every row,
    are taken only for small registries (None otherwise): they catch a row committed out of id order
    at once, where a large registry re-reads a window behind the newest rows instead
    (``RegistryCache``)."""

    count: int | None
    max_id: int | None
    max_updated_at: datetime | None
    ids: int | None = None
    max_message_id_row: int | None = None

    def same_as(self, other: RegistryFingerprint) -> bool:
        """Nothing changed between the two: the newest values agree, and the counts where both have them."""
        if (self.max_id, self.max_updated_at, self.max_message_id_row) != (
            other.max_id,
            other.max_updated_at,
            other.max_message_id_row,
        ):
            return False
        return None in (self.count, other.count) or (self.count, self.ids) == (other.count, other.ids)


# slot rows whose message IDs name nobody: reserved (not claimed yet) and void (given back unused)
UNNAMED = (EndUserSlot.RESERVED.value, EndUserSlot.VOID.value)

# rows per statement of a whole load (10^6 IDs: ten statements of ~0.1-0.3 s each)
LOAD_SLICE = 100_000


class RegistryRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def fingerprint(self, bits: int, block_bits: int, *, counts: bool = True) -> RegistryFingerprint:
        of_length = (MessageId.bits == bits, MessageId.block_bits == block_bits)
        max_row = select(func.max(MessageId.id)).where(*of_length).scalar_subquery()
        newest = (func.max(User.id), func.max(User.updated_at), max_row)
        if not counts:
            max_id, max_updated, max_id_row = (await self._session.execute(select(*newest))).one()
            return RegistryFingerprint(None, max_id, max_updated, None, max_id_row)
        ids = select(func.count(MessageId.id)).where(*of_length).scalar_subquery()
        stmt = select(func.count(User.id), *newest, ids)
        count, max_id, max_updated, max_id_row, id_count = (await self._session.execute(stmt)).one()
        return RegistryFingerprint(int(count or 0), max_id, max_updated, int(id_count or 0), max_id_row)

    async def slices(self, bits: int, block_bits: int) -> AsyncIterator[list[RegistryEntry]]:
        """Every registered message ID of this length with its owner, deleted users included, in the
        order the IDs were allocated, in slices of ``LOAD_SLICE`` rows, each read by a statement of its
        own (so each stays within the request's statement bound however large the registry), for a
        reader that keeps what it needs of a slice before the next is read."""
        after = 0
        while True:
            rows = await self.entries_after(bits, block_bits, after, limit=LOAD_SLICE)
            yield [entry for _, entry in rows]
            if len(rows) < LOAD_SLICE:
                return
            after = rows[-1][0]

    async def entries_after(
        self, bits: int, block_bits: int, row: int, *, limit: int | None = None
    ) -> Sequence[tuple[int, RegistryEntry]]:
        """The message IDs of this length in rows after ``row`` (row id, entry), oldest first."""
        account = func.coalesce(MessageId.user_id, EndUser.user_id)
        # a merged slot's IDs name the end user it was merged into
        into = aliased(EndUser)
        stmt = (
            select(
                MessageId.id.label("row"),
                User.id,
                User.name,
                User.status,
                MessageId.message_id,
                EndUser.id.label("end_user_id"),
                func.coalesce(into.identifier, EndUser.identifier).label("identifier"),
                into.id.label("merged_into"),
            )
            .select_from(MessageId)
            .outerjoin(EndUser, MessageId.end_user_id == EndUser.id)
            .outerjoin(into, into.id == EndUser.merged_into)
            .join(User, User.id == account)
            .where(
                MessageId.bits == bits,
                MessageId.block_bits == block_bits,
                MessageId.id > row,
                # a reserved or void slot names nobody (a claim writes its rows again, as an end user's)
                or_(EndUser.id.is_(None), EndUser.status.not_in(UNNAMED)),
            )
            .order_by(MessageId.id)
            .limit(limit)
        )
        rows = (await self._session.execute(stmt)).all()
        return [
            (r.row, RegistryEntry(r.id, r.name, r.status, r.message_id, r.end_user_id, r.identifier, r.merged_into))
            for r in rows
        ]

    async def users_updated_since(self, since: datetime) -> Sequence[tuple[int, str, str]]:
        """(id, name, status) of the users changed at or after ``since`` (the ``updated_at`` index)."""
        stmt = select(User.id, User.name, User.status).where(User.updated_at >= since)
        return [(r.id, r.name, r.status) for r in (await self._session.execute(stmt)).all()]
