"""End-user slots drawn ahead: a first sight takes one without a statement.

A first sight used to create its end user on the request path: the account's tally locked and
counted, the caps checked, the end user, its message IDs and its audit entry inserted, about 7 ms
of a request on PostgreSQL. ``Reserve`` does that work ahead, in the background, for the accounts
that have first sights in this process: it inserts ``size`` *slots* per account, rows of
``end_users`` with no identifier (``EndUserSlot.RESERVED``), each with one message ID per length in
use, counted on the account's tally and within its caps (a slot is counted as an end user: an
account's end users and the slots reserved for it never pass ``end_users_max``, and slots count
toward ``end_users_new_per_minute`` when they are reserved). A first sight then takes a slot of the
account (``take``), answers with its message IDs at once, and the directory claims it for the
identifier in the background, with its audit entry, in one transaction (``EndUserDirectory``).

* A slot holds its IDs in the registry from the start (the unique constraints), so no other
  account or end user can be given them, and a text encoded with one is never anyone else's.
* Until it is claimed a slot names nobody in a trace; the claim writes its ID rows again, so the
  trace registry's snapshots read them as the end user's.
* Slots are given back unused when the process stops (``aclose``: ``EndUserSlot.VOID``, off the
  tally; the IDs stay reserved), and when the account's caps or the lengths in use change.
* A process renews the slots it holds every ``RENEW_S`` (their rows' ``last_seen_at``, one
  statement per 1,000) and gives a slot out only within ``SLOT_LEASE_S`` of its reservation or
  its last renewal; an older one it gives back instead. A process killed before ``aclose`` leaves
  its slots reserved and counted: once not renewed for ``STALE_SLOT_S`` (past any holder's lease
  and its claim's retries), the account's next reservation or first sight that finds it at its
  cap of end users gives them back (``EndUserRepository.void_stale``), in the transaction that
  holds the account's lock.
* A refill is one transaction per account, at most one at a time per account, for at most
  ``MAX_ACCOUNTS`` accounts per process (the others' first sights create their end users on the
  request path, as with ``size`` 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import session_scope
from service.end_users.id_pool import IdPool
from service.end_users.repository import EndUserRepository
from service.repositories.message_ids import MessageIdRepository
from service.schemas.common import MessageIdOut
from service.services.message_ids import MessageLength
from service.services.users import MAX_ALLOCATION_ATTEMPTS, SPREAD_ALLOCATION_LIMIT, SPREAD_MIN_BITS, Allocator
from xmark_core import Message, WatermarkParams
from xmark_core.errors import MessageSpaceExhausted

logger = logging.getLogger("xmark.end_users")

# accounts a process keeps slots for; past it, new accounts' first sights take the request path
MAX_ACCOUNTS = 1_000
# the most slots one refill reserves (a burst of new identifiers sizes it beyond ``size``)
MAX_REFILL = 256
# an account a refill found at a cap is not refilled again for this long (the per-minute cap's window)
FULL_FOR_S = 60.0
# how often a process renews the slots it holds (their rows' ``last_seen_at``)
RENEW_S = 300.0
# a slot is given out within this long of its reservation or its last renewal; an older one is given back
SLOT_LEASE_S = 900.0
# a slot's row not renewed for this long was left by a process that stopped without giving it back:
# past the lease (900 s), a claim's retries (``directory.CLAIM_RETRY_S``, 300 s), and 2,400 s for
# replicas' clocks that disagree (the time is read from the row)
STALE_SLOT_S = 3600.0
# slots renewed by one statement
RENEW_BATCH = 1_000


@dataclass(slots=True)
class Slot:
    """A reserved row of ``end_users``: its id and its message IDs (shortest length first)."""

    id: int
    message_ids: tuple[MessageIdOut, ...]
    # time.monotonic() when its reservation or its last renewal began (before the row's time): the
    # start of its lease
    leased_at: float = 0.0

    def holds(self, length: MessageLength) -> bool:
        return any((m.bits, m.block_bits) == length for m in self.message_ids)


# (end users in all, new per minute): the caps' values an account's slots were reserved under (0: none)
CapValues = tuple[int, int]


@dataclass(slots=True)
class _Account:
    caps: CapValues
    lengths: tuple[WatermarkParams, ...]
    slots: deque[Slot]
    refill: asyncio.Task[None] | None = None
    # the last refill found the account at a cap: no refill before this (monotonic), or until its caps change
    full_until: float = 0.0
    # first sights that found no slot since the refill in flight started: the next one reserves for them too
    missed: int = 0


class Reserve:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        ids: IdPool,
        allocator: Allocator,
        *,
        size: int,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._ids = ids
        self._allocator = allocator
        self.size = size
        self._on_change = on_change
        self._accounts: dict[int, _Account] = {}
        # slot give-backs under way (caps or lengths changed, the process stopping)
        self._voids: set[asyncio.Task[None]] = set()
        # the loop renewing the slots held (started with the first refill)
        self._renewal: asyncio.Task[None] | None = None

    def held(self, user_id: int) -> int:
        account = self._accounts.get(user_id)
        return 0 if account is None else len(account.slots)

    def _account(self, user_id: int, caps: CapValues, lengths: tuple[WatermarkParams, ...]) -> _Account | None:
        """The account's slots reserved under ``caps`` and for ``lengths`` (others are given back);
        None past ``MAX_ACCOUNTS``."""
        account = self._accounts.get(user_id)
        if account is not None and (account.caps != caps or account.lengths != lengths):
            self._give_back(user_id, account)
            account = None
        if account is None:
            if self.size <= 0 or len(self._accounts) >= MAX_ACCOUNTS:
                return None
            account = self._accounts[user_id] = _Account(caps, lengths, deque())
        return account

    def take(
        self, user_id: int, caps: CapValues, lengths: tuple[WatermarkParams, ...], length: MessageLength
    ) -> Slot | None:
        """A slot of the account holding an ID of ``length``, or None; a refill starts when the
        account holds half ``size`` or fewer."""
        account = self._account(user_id, caps, lengths)
        if account is None:
            return None
        self._expire(user_id, account)
        slot = None
        if account.slots and account.slots[0].holds(length):
            slot = account.slots.popleft()
        else:
            account.missed += 1
        self._top_up(user_id, account)
        return slot

    async def take_after_refill(
        self,
        user_id: int,
        caps: CapValues,
        lengths: tuple[WatermarkParams, ...],
        length: MessageLength,
        timeout_s: float,
    ) -> Slot | None:
        """``take`` once the account's refill in flight has ended (waited for up to ``timeout_s``):
        a burst of new identifiers is served by refills sized to it (``missed``), one unit of work
        per batch, instead of a first sight each under the account's lock. None when the account
        is at a cap, or there is still no slot."""
        account = self._account(user_id, caps, lengths)
        if account is None or time.monotonic() < account.full_until:
            return None
        for _ in range(2):  # the refill in flight may have been sized before this first sight missed
            refill = account.refill
            if refill is None:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(refill)
            if self._accounts.get(user_id) is not account:
                return None
            self._expire(user_id, account)
            if account.slots and account.slots[0].holds(length):
                return account.slots.popleft()
            if not refill.done() or time.monotonic() < account.full_until:
                return None
            self._top_up(user_id, account)
        return None

    def _expire(self, user_id: int, account: _Account) -> None:
        """Give back the account's slots past their lease (the oldest are first)."""
        oldest = time.monotonic() - SLOT_LEASE_S
        expired = []
        while account.slots and account.slots[0].leased_at < oldest:
            expired.append(account.slots.popleft().id)
        if expired:
            self._void_later(user_id, expired)

    def want(self, user_id: int, caps: CapValues, lengths: tuple[WatermarkParams, ...]) -> None:
        """Reserve slots for the account (its first sights are coming through the request path)."""
        account = self._account(user_id, caps, lengths)
        if account is not None:
            self._top_up(user_id, account)

    def _top_up(self, user_id: int, account: _Account) -> None:
        """Refill the account's slots to ``size`` once it holds half of them or fewer: one refill's
        unit of work serves half ``size`` first sights."""
        if (
            len(account.slots) <= self.size // 2
            and time.monotonic() >= account.full_until
            and (account.refill is None or account.refill.done())
        ):
            account.refill = asyncio.create_task(self._refill(user_id, account))
            if self._renewal is None or self._renewal.done():
                self._renewal = asyncio.create_task(self._renew_forever())

    def refilling(self, user_id: int) -> asyncio.Task[None] | None:
        account = self._accounts.get(user_id)
        return None if account is None else account.refill

    async def _refill(self, user_id: int, account: _Account) -> None:
        want = min(MAX_REFILL, self.size - len(account.slots) + account.missed)
        account.missed = 0
        try:
            for _ in range(MAX_ALLOCATION_ATTEMPTS):
                try:
                    async with session_scope(self._sessionmaker) as session:
                        slots = await self._reserve(session, user_id, account, want)
                except _IdTaken:
                    continue
                break
            else:
                return
        except (SQLAlchemyError, OSError, TimeoutError, MessageSpaceExhausted) as exc:
            logger.warning(
                "end-user slots were not reserved; first sights create their end users on the request path",
                extra={"user_id": user_id, "error": type(exc).__name__},
            )
            return
        if self._accounts.get(user_id) is not account:  # given back meanwhile (caps or lengths changed)
            self._void_later(user_id, [s.id for s in slots])
            return
        account.slots.extend(slots)
        if len(slots) < want:
            account.full_until = time.monotonic() + FULL_FOR_S
        if slots and self._on_change is not None:
            self._on_change()

    async def _reserve(self, session: AsyncSession, user_id: int, account: _Account, want: int) -> list[Slot]:
        """Up to ``want`` slots within the account's caps (one transaction: the IDs drawn, then the
        tally locked and counted and the rows and their IDs inserted, so the account's lock, which
        its first sights on the request path wait for, is held for a few statements, not the draw).
        At the cap of end users, the account's stale slots (``STALE_SLOT_S``) are given back first."""
        leased_at = time.monotonic()
        ids = MessageIdRepository(session)
        drawn_ahead = await self._draw(ids, account.lengths, want)
        repo = EndUserRepository(session)
        total = await repo.count_one_more(user_id, want)
        most, per_minute = account.caps
        if most and total + want > most:  # slots a killed process left may be what fills the account
            total -= await repo.void_stale(user_id, datetime.now(UTC) - timedelta(seconds=STALE_SLOT_S))
        room = want
        if most:
            room = min(room, most - total)
        if per_minute:
            now = datetime.now(UTC)
            room = min(room, per_minute - await repo.count(user_id, since=now - timedelta(minutes=1)))
        room = max(0, room)
        if room < want:
            await repo.count_one_less(user_id, want - room)
        if room == 0:
            return []
        messages = drawn_ahead[:room]
        now = datetime.now(UTC)
        slot_ids = await repo.insert_slots(user_id, room, now)
        rows = [
            {
                "end_user_id": slot_id,
                "bits": m.params.bits,
                "block_bits": m.params.block_bits,
                "message_id": m.bits,
                "created_at": now,
            }
            for slot_id, drawn in zip(slot_ids, messages, strict=True)
            for m in drawn
        ]
        if await ids.insert_if_free(rows) != len(rows):
            raise _IdTaken  # rolls the slots back with it
        return [
            Slot(
                slot_id,
                tuple(
                    MessageIdOut(bits=m.params.bits, block_bits=m.params.block_bits, message_id=m.bits)
                    for m in sorted(drawn, key=lambda m: (m.params.bits, m.params.block_bits))
                ),
                leased_at,
            )
            for slot_id, drawn in zip(slot_ids, messages, strict=True)
        ]

    async def _draw(
        self, ids: MessageIdRepository, lengths: tuple[WatermarkParams, ...], n: int
    ) -> list[list[Message]]:
        """``n`` sets of one new message ID per length: the pool's (``IdPool``) first, the rest drawn
        here by the allocation rule with one read of the registry per length (a worker thread scores)."""
        sets: list[list[Message]] = []
        while len(sets) < n:
            taken = self._ids.take(lengths)
            if taken is None:
                break
            sets.append(taken)
        more = n - len(sets)
        if more <= 0:
            return sets
        large = await ids.newest_row() >= SPREAD_ALLOCATION_LIMIT
        registered = [
            [] if large and p.bits >= SPREAD_MIN_BITS else await ids.existing(p.bits, p.block_bits) for p in lengths
        ]
        held = [[m.bits for s in sets for m in s if m.params == p] for p in lengths]

        def draw() -> list[list[Message]]:
            columns = []
            for params, existing, mine in zip(lengths, registered, held, strict=True):
                taken = existing + mine
                column = []
                for _ in range(more):
                    message = self._allocator(taken, params)
                    taken.append(message.bits)
                    column.append(message)
                columns.append(column)
            return [list(row) for row in zip(*columns, strict=True)]

        return sets + await asyncio.to_thread(draw)

    def _give_back(self, user_id: int, account: _Account) -> None:
        del self._accounts[user_id]
        if account.slots:
            self._void_later(user_id, [s.id for s in account.slots])
            account.slots.clear()

    def _void_later(self, user_id: int, slot_ids: list[int]) -> None:
        task = asyncio.create_task(self._void(user_id, slot_ids))
        self._voids.add(task)
        task.add_done_callback(self._voids.discard)

    async def _void(self, user_id: int, slot_ids: Sequence[int]) -> None:
        try:
            async with session_scope(self._sessionmaker) as session:
                await EndUserRepository(session).void(user_id, slot_ids)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            logger.warning(
                "unused end-user slots were not given back; they stay counted on the account's tally",
                extra={"user_id": user_id, "slots": len(slot_ids), "error": type(exc).__name__},
            )

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            await self.renew()

    async def renew(self) -> None:
        """Write that this process still holds its slots (their rows' ``last_seen_at``), so that no
        other process takes them for a killed one's; their leases start again. A failure is logged:
        the slots' leases run on, and past them the slots are given back."""
        started = time.monotonic()
        held = [slot for account in self._accounts.values() for slot in account.slots]
        try:
            for first in range(0, len(held), RENEW_BATCH):
                batch = held[first : first + RENEW_BATCH]
                async with session_scope(self._sessionmaker) as session:
                    await EndUserRepository(session).renew([s.id for s in batch], datetime.now(UTC))
                for slot in batch:
                    slot.leased_at = max(slot.leased_at, started)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            logger.warning(
                "end-user slots were not renewed; past their lease they are given back",
                extra={"slots": len(held), "error": type(exc).__name__},
            )

    def clear(self) -> None:
        """Give every slot back (the lengths in use changed)."""
        for user_id, account in list(self._accounts.items()):
            self._give_back(user_id, account)

    async def aclose(self) -> None:
        """Stop the refills and give the unused slots back."""
        refills = [a.refill for a in self._accounts.values() if a.refill is not None and not a.refill.done()]
        if self._renewal is not None:
            refills.append(self._renewal)
        for task in refills:
            task.cancel()
        await asyncio.gather(*refills, return_exceptions=True)
        self.clear()
        await asyncio.gather(*self._voids, return_exceptions=True)


class _IdTaken(Exception):
    """A drawn message ID was inserted by another transaction first: the refill starts over."""
