"""The request path of end users: the identifier a request names -> the end user it is generated for.

* **Warm** (a known end user, cached): no database round trip. The cache is per process, keyed by
  (account, identifier), holds the end user's id, status, message IDs and own rate limits for
  ``ttl`` seconds (the authentication cache's TTL) and at most ``max_entries`` of them (least
  recently used leave first). The account's end-user limits travel with the account
  (``Principal``, from the authentication cache).
* **Cold, known**: one statement reads the end user with its message IDs; ``last_seen_at`` is
  written when the last write is more than a minute old. An end user without an ID of the length the
  request is encoded with (a key version of a new length) gets one there, unless the background
  backfill (``backfill``, run at start-up and after an activation) gave it one first.
* **Cache miss with slots** (``end_users_reserve`` > 0, the default): one statement outside a
  transaction reads the end user (``_probe``). A known one (with an ID of the request's length,
  seen within a minute) is cached and answered. A new one takes one of the account's slots reserved
  ahead (``service.end_users.reserve``: rows with their message IDs, counted within the caps when
  reserved) and is answered with the slot's IDs at once; the slot is claimed for the identifier,
  with its audit entry, in the background, when the request's record is written (after the answer)
  or a second later (``_claim``); a record waits for its claim (``settled``). A claim that finds
  the identifier taken by another replica's first sight meanwhile merges the slot into that end
  user (``end_user.merge``): the texts of either ID name it. Otherwise (no slot held yet, the
  lengths in use not read within ``cache.ttl``), the session path below.
* **First sight** (session path): the account's caps are checked first (its ``end_users_max`` and
  ``end_users_new_per_minute`` where set, else the settings ``end_users_max_per_account`` and
  ``end_users_new_per_minute``: 429 ``end_user_limit_exceeded``, nothing allocated) under the
  account's end-user lock: its row of ``end_user_tallies``, counted one more
  (``EndUserRepository.count_one_more``: the total is one row, not a count of the account's end
  users); the end user is read again if a cap would refuse it (a concurrent first sight may have
  created it). An account found at a cap is remembered for ``cache.ttl`` seconds (while its caps
  stay the same): its new identifiers are then refused without the lock and the count; and every
  cap refusal is answered
  ``end_users_refusal_delay_s`` late (``_hold_back``), so a flood of invented identifiers costs the
  database one read per request, a few requests a second. The end user is inserted with
  ``ON CONFLICT DO NOTHING`` on (account, identifier) with one new message ID per length in use
  (the lengths read at most once per ``cache.ttl``), taken from the IDs drawn ahead by the
  registry's allocation rule (``IdPool``; drawn here when it is empty), inserted with
  ``ON CONFLICT DO NOTHING``: an ID another transaction took first rolls the first sight back and it
  starts over. The creation is recorded in the audit trail as made by the account (actor
  ``api``). Two first sights racing for one identifier end with one end user.
* **Bursts**: the requests of one end user that miss the cache together share one look-up in
  this process (the first does it; the others await its answer or its error), so a burst of a new
  identifier's requests takes the account's lock once per replica, not once per request; and at
  most half the database pool's connections look end users up at once (the others wait their turn,
  up to ``LOOKUP_QUEUE_TIMEOUT_S``), so a burst of new identifiers leaves the pool to the rest.
* A disabled or deleted end user is refused with 403, like a disabled account; the account's other
  end users are unaffected. Admin changes through this process drop the entry at once and again
  when they commit; other replicas see them within ``ttl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import bindparam, event, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from service.config import Settings
from service.db import session_scope
from service.end_users.id_pool import IdPool
from service.end_users.known import KnownIdentifiers
from service.end_users.repository import EndUserRepository, FoundEndUser
from service.end_users.reserve import STALE_SLOT_S, Reserve, Slot
from service.errors import ConflictError, DatabaseUnavailableError, PermissionDeniedError, RateLimitError
from service.models import EndUser, MessageId
from service.repositories.message_ids import MessageIdRepository
from service.schemas.common import EndUserIdentity, MessageIdOut, Principal
from service.services.audit import SYSTEM_ACTOR, Actor, AuditTrail, AuditTrailError, Change
from service.services.message_ids import (
    MessageLength,
    backfill_end_user_message_ids,
    length_of,
    lengths_in_use,
    message_ids_out,
)
from service.services.reports import ReportSigner
from service.services.users import MAX_ALLOCATION_ATTEMPTS, Allocator, allocate_one, choose_message_ids
from service.vocabulary import AuditAction, AuditTarget, EndUserStatus
from xmark_core import Message, WatermarkParams
from xmark_core.encoders import KeyVersionSpec

logger = logging.getLogger("xmark.end_users")

SEEN_RESOLUTION = timedelta(minutes=1)
# how long a look-up waits for its turn among this process's look-ups in progress (see ``resolve``)
LOOKUP_QUEUE_TIMEOUT_S = 30.0
LIMIT_CODE = "end_user_limit_exceeded"
# accounts remembered at a cap before those whose time is up are forgotten
AT_CAP_ACCOUNTS = 10_000
# a claim of a slot (``_claim``) is retried this long while the database is unreachable
CLAIM_RETRY_S = 300.0
# a claim starts at the latest this long after its first sight (else when its first record is written)
CLAIM_DELAY_S = 1.0
# merged slots remembered (slot id -> the end user it was merged into) for records still to be written
MERGED_REMEMBERED = 10_000


class _IdTaken(Exception):
    """A drawn message ID was inserted by another transaction first: the first sight starts over."""


@dataclass(frozen=True, slots=True)
class Cap:
    """One cap on an account's end users: its value (0: unlimited) and where it comes from (the
    account's override, named as the admin API names it, or the setting)."""

    value: int
    name: str

    @classmethod
    def of(cls, override: int | None, field: str, default: int, setting: str) -> Cap:
        if override is None:
            return cls(default, setting)
        return cls(override, f"this account's {field}")


@dataclass(frozen=True, slots=True)
class _AtCap:
    """An account found at one of its caps: new identifiers are refused without the lock and the
    count until ``until`` (monotonic), while its caps stay ``caps``."""

    caps: tuple[Cap, Cap]
    cap: Cap
    what: str
    until: float


@dataclass(slots=True)
class _Entry:
    identity: EndUserIdentity
    status: str
    expires_at: float


# the probe of a cache miss (``_probe``): the end user's row with its message IDs, one statement
_PROBE = (
    select(
        EndUser.id,
        EndUser.status,
        EndUser.last_seen_at,
        EndUser.requests_per_minute,
        EndUser.tokens_per_minute,
        MessageId.bits,
        MessageId.block_bits,
        MessageId.message_id,
    )
    .outerjoin(MessageId, MessageId.end_user_id == EndUser.id)
    .where(EndUser.user_id == bindparam("user_id"), EndUser.identifier == bindparam("identifier"))
)


class _LeaderGone(Exception):
    """The request doing a shared look-up was cancelled: the requests awaiting it look again."""


def _retrieved(future: asyncio.Future[tuple[EndUserIdentity, str]]) -> None:
    """Mark a shared look-up's error as seen when no request awaited it (no warning at exit)."""
    if not future.cancelled():
        future.exception()


def identity_of(row: EndUser, message_ids: Sequence[MessageId]) -> EndUserIdentity:
    ids = message_ids_out(message_ids)
    assert row.identifier is not None, "a slot row is not an end user"
    return EndUserIdentity(
        id=row.id,
        identifier=row.identifier,
        message_ids=tuple(ids),
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
    )


def refusal(status: str) -> PermissionDeniedError:
    """403 for an end user that may not generate (its status)."""
    if status == EndUserStatus.DELETED:
        return PermissionDeniedError("This end user has been deleted", code="end_user_deleted")
    return PermissionDeniedError("This end user is disabled", code="end_user_disabled")


def _created(end_user_id: int, user_id: int, identifier: str, now: datetime) -> EndUser:
    """The end user a first sight inserted, as ``EndUserRepository.insert`` wrote it."""
    return EndUser(
        id=end_user_id,
        user_id=user_id,
        identifier=identifier,
        status=EndUserStatus.ACTIVE.value,
        created_at=now,
        last_seen_at=now,
        requests_per_minute=None,
        tokens_per_minute=None,
    )


def end_user_created(row: EndUser, message_ids: Sequence[MessageId]) -> Change:
    after = {
        "user_id": row.user_id,
        "identifier": row.identifier,
        "status": row.status,
        "message_ids": [m.model_dump() for m in message_ids_out(message_ids)],
    }
    return Change(AuditAction.END_USER_CREATE, AuditTarget.END_USER, row.id, None, after)


def _limit_exceeded(cap: Cap, what: str) -> RateLimitError:
    return RateLimitError(
        f"This account has reached its limit of {cap.value} {what} ({cap.name}); no new end user was created",
        retry_after_s=60,
        code=LIMIT_CODE,
    )


class EndUserCache:
    """Known end users of this process, by (account id, identifier)."""

    def __init__(self, ttl: float, max_entries: int = 10_000, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[tuple[int, str], _Entry] = OrderedDict()
        self._epoch = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def get(self, key: tuple[int, str]) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() >= entry.expires_at:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[int, str], identity: EndUserIdentity, status: str, *, epoch: int) -> None:
        if self.ttl <= 0 or epoch != self._epoch:
            return
        self._entries[key] = _Entry(identity, status, self._clock() + self.ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def invalidate(self, end_user_id: int, session: AsyncSession | None = None) -> None:
        """Forget the end user now and, given the changing ``session``, again when it commits."""

        def drop() -> None:
            self._epoch += 1
            for key in [k for k, e in self._entries.items() if e.identity.id == end_user_id]:
                del self._entries[key]

        drop()
        if session is not None:
            event.listen(session.sync_session, "after_commit", lambda _: drop(), once=True)

    def clear(self) -> None:
        self._epoch += 1
        self._entries.clear()


class EndUserDirectory:
    def __init__(
        self,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        settings: Settings,
        configured: WatermarkParams | KeyVersionSpec,
        signer: ReportSigner,
        cache: EndUserCache,
        on_change: Callable[[], None] | None = None,
        allocator: Allocator = allocate_one,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._settings = settings
        self._configured = configured
        self._signer = signer
        self.cache = cache
        self._on_change = on_change
        self._allocator = allocator
        # (account, identifier) -> the look-up in progress in this process (see ``resolve``)
        self._pending: dict[tuple[int, str], asyncio.Future[tuple[EndUserIdentity, str]]] = {}
        # at most half the database pool's connections look end users up at once
        self._turns = asyncio.Semaphore(max(1, settings.database_pool_size // 2))
        # and at most a quarter of them claim slots (``_claim``)
        self._claim_turns = asyncio.Semaphore(max(1, settings.database_pool_size // 4))
        # the backfills of end users' IDs of a length that became usable (``backfill``)
        self._backfills: set[asyncio.Task[None]] = set()
        # message IDs drawn ahead for first sights
        self.ids = IdPool(sessionmaker, allocator, size=settings.end_users_ids_ahead)
        # end-user slots reserved ahead for first sights (``service.end_users.reserve``), the claims
        # of taken slots in progress (slot id -> the end user its texts name once claimed), and the
        # merged slots' end users
        self.reserve = Reserve(sessionmaker, self.ids, allocator, size=settings.end_users_reserve)
        # the identifiers of the accounts holding slots: a first sight surely new reads nothing
        self.known = KnownIdentifiers(sessionmaker, refresh_s=cache.ttl if settings.end_users_reserve > 0 else 0.0)
        self._claims: dict[int, asyncio.Future[int]] = {}
        self._claim_wanted: dict[int, asyncio.Event] = {}
        self._claiming: set[asyncio.Task[None]] = set()
        self._merged: OrderedDict[int, int] = OrderedDict()
        bind = sessionmaker.kw.get("bind")
        # the probe of a cache miss reads outside a transaction (no BEGIN, no COMMIT)
        self._probe_engine: AsyncEngine | None = (
            bind.execution_options(isolation_level="AUTOCOMMIT") if isinstance(bind, AsyncEngine) else None
        )
        # the lengths in use, read at most once per ``cache.ttl`` (monotonic time read, lengths)
        self._lengths: tuple[float, tuple[WatermarkParams, ...]] | None = None
        # accounts found at a cap (``_AtCap``), and the cap refusals being held back now
        self._at_cap: dict[int, _AtCap] = {}
        self._held_back = 0

    def ids_added(self, more: bool) -> None:
        """End users were given IDs of a new length outside this directory (an activation's first
        batch): forget the cached identities, which lack them, and, ``more``, backfill the rest."""
        self._batch_done()
        if more:
            self.backfill()

    def _batch_done(self) -> None:
        self.cache.clear()  # cached identities lack the new IDs
        self._lengths = None
        self.ids.clear()  # drawn for the lengths in use before
        self.reserve.clear()
        if self._on_change is not None:
            self._on_change()

    def backfill(self) -> asyncio.Task[None]:
        """Give every end user an ID of each length in use it lacks, in the background: batches of
        ``BACKFILL_BATCH`` end users, each a unit of work of its own recorded in the audit trail as
        the gateway's (``message_ids.allocate``), so a large directory is neither one transaction
        nor a wait before serving. Run at start-up and after an activation left end users without
        an ID of its length (``ids_added``); an end user's request before its batch gets its ID on
        that request, as before. A failure is logged: the request path covers whom it missed."""
        task = asyncio.create_task(self._backfill())
        self._backfills.add(task)
        task.add_done_callback(self._backfills.discard)
        return task

    async def _backfill(self) -> None:
        try:
            async with session_scope(self._sessionmaker) as session:
                lengths = (await lengths_in_use(session, self._configured)).params
            await backfill_end_user_message_ids(
                self._sessionmaker, lengths, audit=AuditTrail(self._signer, SYSTEM_ACTOR), on_batch=self._batch_done
            )
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            logger.warning(
                "end users' message IDs of a new length were not backfilled; their requests allocate them",
                extra={"error": type(exc).__name__},
            )

    async def aclose(self) -> None:
        """Stop the backfills in progress (a batch not committed is rolled back, and the next run
        or the request path takes it up)."""
        for task in list(self._backfills):
            task.cancel()
        await asyncio.gather(*self._backfills, return_exceptions=True)
        # the claims of slots already answered with are finished (retried up to their bound)
        for wanted in self._claim_wanted.values():
            wanted.set()
        if self._claiming:
            await asyncio.wait(set(self._claiming), timeout=self._settings.database_timeout_s)
        await self.reserve.aclose()
        await self.known.aclose()
        await self.ids.aclose()

    async def resolve(
        self, principal: Principal, identifier: str, length: MessageLength, *, request_id: str | None = None
    ) -> EndUserIdentity:
        """The account's end user named ``identifier``, holding an ID of ``length`` (created on first
        sight); 403 for a disabled or deleted one, 429 past the account's caps.

        Requests of one end user that miss the cache together share one database look-up in this
        process (the first does it, the others await its result, or its error): a burst of a new
        identifier's requests takes the account's end-user lock once, not once per request."""
        try:
            return await self._resolve(principal, identifier, length, request_id)
        except RateLimitError as refused:
            if refused.code == LIMIT_CODE:
                await self._hold_back()
            raise

    async def _hold_back(self) -> None:
        """Answer a cap refusal ``end_users_refusal_delay_s`` late (at once when
        ``end_users_max_held_back`` refusals are waiting already): an account flooding new
        identifiers over a few connections then sends a few a second, and leaves the gateway to the
        other accounts (the failed-authentication budget holds its refusals back alike)."""
        delay = self._settings.end_users_refusal_delay_s
        if delay <= 0 or self._held_back >= self._settings.end_users_max_held_back:
            return
        self._held_back += 1
        try:
            await asyncio.sleep(delay)
        finally:
            self._held_back -= 1

    async def _resolve(
        self, principal: Principal, identifier: str, length: MessageLength, request_id: str | None
    ) -> EndUserIdentity:
        key = (principal.user_id, identifier)
        while True:
            entry = self.cache.get(key)
            if entry is not None and entry.identity.message_id_for(*length) is not None:
                if entry.status != EndUserStatus.ACTIVE:
                    raise refusal(entry.status)
                return entry.identity
            pending = self._pending.get(key)
            if pending is None:
                break
            try:
                identity, status = await asyncio.shield(pending)
            except _LeaderGone:
                continue  # the request that looked it up went away: look again
            if identity.message_id_for(*length) is None:
                break  # it looked up another length (a key version of a new length): this one fills it
            if status != EndUserStatus.ACTIVE:
                raise refusal(status)
            return identity
        looked_up: asyncio.Future[tuple[EndUserIdentity, str]] = asyncio.get_running_loop().create_future()
        looked_up.add_done_callback(_retrieved)
        self._pending[key] = looked_up
        try:
            identity, status = await self._look_up(principal, identifier, length, key, request_id)
        except asyncio.CancelledError:
            looked_up.set_exception(_LeaderGone())
            raise
        except Exception as exc:
            looked_up.set_exception(exc)
            raise
        else:
            looked_up.set_result((identity, status))
        finally:
            if self._pending.get(key) is looked_up:
                del self._pending[key]
        if status != EndUserStatus.ACTIVE:
            raise refusal(status)
        return identity

    async def _look_up(
        self,
        principal: Principal,
        identifier: str,
        length: MessageLength,
        key: tuple[int, str],
        request_id: str | None,
    ) -> tuple[EndUserIdentity, str]:
        """The database's end user (created on first sight), put in the cache; its identity and status.

        A look-up waits for its turn (half the pool's connections look up at once, so a burst of
        new identifiers neither empties the pool for the rest of the gateway nor fails at the pool's
        checkout bound); past ``LOOKUP_QUEUE_TIMEOUT_S`` it is refused with 503 and Retry-After."""
        try:
            async with asyncio.timeout(LOOKUP_QUEUE_TIMEOUT_S):
                await self._turns.acquire()
        except TimeoutError:
            raise DatabaseUnavailableError(
                "Too many new end users are being looked up at once; retry shortly", retry_after_s=1.0
            ) from None
        try:
            if self.reserve.size > 0 and self._probe_engine is not None:
                fast = await self._probe(principal, identifier, length, key, request_id)
                if fast is not None:
                    return fast
            for _ in range(MAX_ALLOCATION_ATTEMPTS):
                epoch = self.cache.epoch
                try:
                    async with session_scope(self._sessionmaker) as session:
                        found = await self._read_or_create(session, principal, identifier, length, request_id)
                        identity, status = identity_of(found.row, found.message_ids), found.row.status
                except _IdTaken:
                    logger.info("message ID taken concurrently; allocating again")
                    continue
                self.cache.put(key, identity, status, epoch=epoch)
                return identity, status
            raise ConflictError("Could not allocate a unique message ID; retry the request", code="message_id_conflict")
        finally:
            self._turns.release()

    async def _probe(
        self,
        principal: Principal,
        identifier: str,
        length: MessageLength,
        key: tuple[int, str],
        request_id: str | None,
    ) -> tuple[EndUserIdentity, str] | None:
        """The cache miss of a process holding slots. An identifier surely new to the account (its
        identifiers known to this process, ``KnownIdentifiers``) takes a reserved slot of the
        account (``Reserve.take``) with no statement. Otherwise one statement outside a transaction
        reads the end user: known (with an ID of ``length``, seen within ``SEEN_RESOLUTION``), its
        identity; new, a slot. A slot is within the account's caps (checked when it was reserved)
        and claimed in the background (``_claim``). None (no slot held, the lengths in use not
        read within ``cache.ttl``, a known end user to update): the request takes the session path."""
        assert self._probe_engine is not None
        epoch = self.cache.epoch
        user_id = principal.user_id
        caps = self.caps(principal)
        lengths = self._fresh_lengths(length)
        if lengths is not None and self.known.surely_new(user_id, identifier):
            # no statement: the account's identifiers are known, and this one is not among them
            slot = self.reserve.take(user_id, (caps[0].value, caps[1].value), lengths, length)
            if slot is not None:
                return self._took(slot, principal, identifier, key, request_id, epoch)
        async with self._probe_engine.connect() as connection:
            rows = (await connection.execute(_PROBE, {"user_id": principal.user_id, "identifier": identifier})).all()
        if rows:
            first = rows[0]
            if datetime.now(UTC) - first.last_seen_at >= SEEN_RESOLUTION:
                return None  # the session path writes last_seen_at
            identity = EndUserIdentity(
                id=first.id,
                identifier=identifier,
                message_ids=tuple(
                    MessageIdOut(bits=r.bits, block_bits=r.block_bits, message_id=r.message_id)
                    for r in sorted(rows, key=lambda r: (r.bits or 0, r.block_bits or 0))
                    if r.message_id is not None
                ),
                requests_per_minute=first.requests_per_minute,
                tokens_per_minute=first.tokens_per_minute,
            )
            if identity.message_id_for(*length) is None:
                return None  # the session path gives it an ID of this length
            self.cache.put(key, identity, first.status, epoch=epoch)
            return identity, first.status
        slot = None
        if lengths is not None:
            # a slot held is within the caps (counted when it was reserved), even at a cap now
            values = (caps[0].value, caps[1].value)
            slot = self.reserve.take(user_id, values, lengths, length)
            self.known.want(user_id)
            if slot is None:  # a burst: the refill in flight reserves for it too
                timeout_s = self._settings.database_timeout_s
                slot = await self.reserve.take_after_refill(user_id, values, lengths, length, timeout_s)
        if slot is None:
            self._refuse_if_at_cap(user_id, caps)
            return None
        return self._took(slot, principal, identifier, key, request_id, epoch)

    def _took(
        self,
        slot: Slot,
        principal: Principal,
        identifier: str,
        key: tuple[int, str],
        request_id: str | None,
        epoch: int,
    ) -> tuple[EndUserIdentity, str]:
        """A first sight answered with ``slot``: cached, known, and claimed in the background."""
        identity = EndUserIdentity(id=slot.id, identifier=identifier, message_ids=slot.message_ids)
        self.cache.put(key, identity, EndUserStatus.ACTIVE.value, epoch=epoch)
        self.known.add(principal.user_id, identifier)
        self._claim_later(slot, principal, identifier, key, request_id)
        return identity, EndUserStatus.ACTIVE.value

    def _fresh_lengths(self, length: MessageLength) -> tuple[WatermarkParams, ...] | None:
        """The lengths in use as read within ``cache.ttl``, when ``length`` is among them."""
        if self._lengths is None:
            return None
        read_at, params = self._lengths
        if time.monotonic() - read_at < self.cache.ttl and any(length_of(p) == length for p in params):
            return params
        return None

    def _claim_later(
        self, slot: Slot, principal: Principal, identifier: str, key: tuple[int, str], request_id: str | None
    ) -> None:
        settled: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._claims[slot.id] = settled
        wanted = self._claim_wanted[slot.id] = asyncio.Event()
        task = asyncio.create_task(self._claim(slot, principal, identifier, key, request_id, settled, wanted))
        self._claiming.add(task)
        task.add_done_callback(self._claiming.discard)

    async def _claim(
        self,
        slot: Slot,
        principal: Principal,
        identifier: str,
        key: tuple[int, str],
        request_id: str | None,
        settled: asyncio.Future[int],
        wanted: asyncio.Event,
    ) -> None:
        """Make the taken slot the end user ``identifier`` with its audit entry, in one transaction;
        when another replica's first sight created that end user first, merge the slot into it (its
        texts name that end user, ``end_user.merge`` in the audit trail) and cache that one. Retried
        while the database is unreachable, up to ``CLAIM_RETRY_S``.

        It starts when the first generation record of the end user is written (``settled``: after
        the answer, so the claim's statements are not on the request's path, and no later than the
        record), or ``CLAIM_DELAY_S`` after the first sight, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLAIM_DELAY_S):
                await wanted.wait()
        audit = AuditTrail(self._signer, Actor.api(principal.user_id, principal.name), request_id)
        final = slot.id
        delay, give_up = 0.05, time.monotonic() + CLAIM_RETRY_S
        try:
            while True:
                try:
                    # claims take turns of their own (a quarter of the pool's connections at once),
                    # so a burst of first sights leaves the pool to the look-ups, the records and the rest
                    async with self._claim_turns:
                        final = await self._claim_once(slot, principal.user_id, identifier, key, audit)
                    break
                except (SQLAlchemyError, OSError, TimeoutError, AuditTrailError) as exc:
                    if time.monotonic() + delay > give_up:
                        logger.error(
                            "an end user's first sight was not recorded: its texts name the account only",
                            extra={"user_id": principal.user_id, "end_user_id": slot.id, "error": type(exc).__name__},
                        )
                        break
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            settled.set_result(final)
            self._claims.pop(slot.id, None)
            self._claim_wanted.pop(slot.id, None)
            if final != slot.id:
                self._merged[slot.id] = final
                while len(self._merged) > MERGED_REMEMBERED:
                    self._merged.popitem(last=False)
        if self._on_change is not None:
            self._on_change()

    async def _claim_once(
        self, slot: Slot, user_id: int, identifier: str, key: tuple[int, str], audit: AuditTrail
    ) -> int:
        now = datetime.now(UTC)
        async with session_scope(self._sessionmaker) as session:
            repo = EndUserRepository(session)
            try:
                async with session.begin_nested():
                    claimed = await repo.claim(slot.id, identifier, now)
            except IntegrityError:  # the unique constraint: another replica created it first
                winner = await repo.find(user_id, identifier)
                if winner is None:
                    raise  # not that constraint: retried
                if await repo.merge(slot.id, winner.row.id):
                    await repo.renumber_message_ids(slot.id)  # the registry's snapshots read them now
                    after = {"merged_into": winner.row.id, "identifier": identifier}
                    change = Change(AuditAction.END_USER_MERGE, AuditTarget.END_USER, slot.id, None, after)
                    await audit.record(session, change)
                epoch = self.cache.epoch
                found = winner
            else:
                if not claimed:
                    logger.error("a taken end-user slot was no longer reserved", extra={"end_user_id": slot.id})
                    return slot.id
                await repo.renumber_message_ids(slot.id)
                rows = [
                    MessageId(end_user_id=slot.id, bits=m.bits, block_bits=m.block_bits, message_id=m.message_id)
                    for m in slot.message_ids
                ]
                await audit.record(session, end_user_created(_created(slot.id, user_id, identifier, now), rows))
                logger.info("end user created", extra={"user_id": user_id, "end_user_id": slot.id})
                return slot.id
        self.cache.put(key, identity_of(found.row, found.message_ids), found.row.status, epoch=epoch)
        logger.info("end user merged", extra={"user_id": user_id, "end_user_id": found.row.id})
        return found.row.id

    def claiming(self, end_user_id: int) -> bool:
        """Whether ``end_user_id`` is a slot taken by a first sight whose claim has not settled, or
        one merged into another end user (``settled`` then answers which)."""
        return end_user_id in self._claims or end_user_id in self._merged

    async def settled(self, end_user_id: int) -> int:
        """The end user a generation of ``end_user_id`` is recorded for: itself, or, for a slot taken
        by a first sight, the end user its claim settles on (waited for up to the database bound)."""
        merged = self._merged.get(end_user_id)
        if merged is not None:
            return merged
        pending = self._claims.get(end_user_id)
        if pending is None:
            return end_user_id
        wanted = self._claim_wanted.get(end_user_id)
        if wanted is not None:
            wanted.set()
        try:
            async with asyncio.timeout(self._settings.database_timeout_s):
                return await asyncio.shield(pending)
        except TimeoutError:
            return end_user_id

    async def _read_or_create(
        self,
        session: AsyncSession,
        principal: Principal,
        identifier: str,
        length: MessageLength,
        request_id: str | None,
    ) -> FoundEndUser:
        repo = EndUserRepository(session)
        found = await repo.find(principal.user_id, identifier)
        if found is None:
            audit = AuditTrail(self._signer, Actor.api(principal.user_id, principal.name), request_id)
            return await self._first_sight(session, repo, principal, identifier, length, audit)
        if not any((m.bits, m.block_bits) == length for m in found.message_ids):
            return await self._fill(session, repo, found)
        now = datetime.now(UTC)
        if now - found.row.last_seen_at >= SEEN_RESOLUTION:
            await repo.seen(found.row.id, now)
        return found

    async def _lengths_in_use(self, session: AsyncSession, length: MessageLength) -> tuple[WatermarkParams, ...]:
        """The lengths in use (``lengths_in_use``), read at most once per ``cache.ttl``, and again
        when ``length`` (the request's) is not among them: a key version of a new length."""
        now = time.monotonic()
        if self._lengths is not None:
            read_at, params = self._lengths
            if now - read_at < self.cache.ttl and any(length_of(p) == length for p in params):
                return params
        params = (await lengths_in_use(session, self._configured)).params
        if self._lengths is not None and {length_of(p) for p in params} != {length_of(p) for p in self._lengths[1]}:
            self.ids.clear()  # drawn for other lengths
        self._lengths = (now, params)
        return params

    async def _first_sight(
        self,
        session: AsyncSession,
        repo: EndUserRepository,
        principal: Principal,
        identifier: str,
        length: MessageLength,
        audit: AuditTrail,
    ) -> FoundEndUser:
        """Create the end user (``found`` was None in this transaction): the message IDs (drawn ahead
        by ``ids``, else drawn here, before the account's lock), then under the lock the caps, the
        rows and the audit entry. Raises ``_IdTaken`` when another transaction inserted a drawn ID
        first (the caller starts over)."""
        user_id = principal.user_id
        caps = self.caps(principal)
        self._refuse_if_at_cap(user_id, caps)
        now = datetime.now(UTC)
        if self.reserve.size > 0:  # the account's next first sights take slots
            self.reserve.want(user_id, (caps[0].value, caps[1].value), await self._lengths_in_use(session, length))
            self.known.want(user_id)
        # the message IDs, drawn before the account's lock is taken (its other first sights wait for it)
        lengths = await self._lengths_in_use(session, length)
        messages: list[Message] | None = self.ids.take(lengths)
        if messages is None:
            messages = await choose_message_ids(MessageIdRepository(session), lengths, self._allocator)
        # the account's lock, and its end users before this one
        total = await repo.count_one_more(user_id)
        if caps[0].value and total >= caps[0].value:  # slots a killed process left may be what fills it
            total -= await repo.void_stale(user_id, now - timedelta(seconds=STALE_SLOT_S))
        # the new end users of the last minute are at most all of them: counted only when those reach
        # the per-minute cap
        recent = total
        if caps[1].value and total >= caps[1].value:
            recent = await repo.count(user_id, since=now - timedelta(minutes=1))
        try:
            self._check_caps(user_id, caps, total=total, recent=recent)
        except RateLimitError:
            # a concurrent first sight may have created it while this one waited for the lock
            found = await repo.find(user_id, identifier)
            if found is not None:
                await repo.count_one_less(user_id)
                return found
            raise  # the tally's count is rolled back with the rest
        end_user_id = await repo.insert(user_id, identifier, now)
        if end_user_id is None:  # the unique constraint: a concurrent first sight created it
            await repo.count_one_less(user_id)
            found = await repo.find(user_id, identifier)
            assert found is not None
            return found
        rows = [
            MessageId(
                end_user_id=end_user_id,
                bits=m.params.bits,
                block_bits=m.params.block_bits,
                message_id=m.bits,
                created_at=now,
            )
            for m in messages
        ]
        inserted = await MessageIdRepository(session).insert_if_free(
            [
                {
                    "end_user_id": end_user_id,
                    "bits": r.bits,
                    "block_bits": r.block_bits,
                    "message_id": r.message_id,
                    "created_at": now,
                }
                for r in rows
            ]
        )
        if inserted != len(rows):
            raise _IdTaken  # rolls the end user back with it
        # the rows as inserted (read back they are the same): no statement more
        found = FoundEndUser(_created(end_user_id, user_id, identifier, now), tuple(rows))
        await audit.record(session, end_user_created(found.row, found.message_ids))
        if self._on_change is not None:
            self._on_change()
        logger.info("end user created", extra={"user_id": user_id, "end_user_id": end_user_id})
        self.known.add(user_id, identifier)  # a roll-back leaves a hash of nobody: read, not trusted
        return found

    def caps(self, principal: Principal) -> tuple[Cap, Cap]:
        """The account's caps on its end users (in all, new per minute): its own where set, else
        the settings'."""
        s = self._settings
        return (
            Cap.of(principal.end_users_max, "end_users_max", s.end_users_max_per_account, "end_users_max_per_account"),
            Cap.of(
                principal.end_users_new_per_minute,
                "end_users_new_per_minute",
                s.end_users_new_per_minute,
                "end_users_new_per_minute",
            ),
        )

    def _check_caps(self, user_id: int, caps: tuple[Cap, Cap], *, total: int, recent: int) -> None:
        for cap, count, what in zip(caps, (total, recent), ("end users", "new end users per minute"), strict=True):
            if cap.value and count >= cap.value:
                if self.cache.ttl > 0:
                    now = time.monotonic()
                    if len(self._at_cap) >= AT_CAP_ACCOUNTS:  # forget the accounts whose time is up
                        self._at_cap = {k: v for k, v in self._at_cap.items() if v.until > now}
                    self._at_cap[user_id] = _AtCap(caps, cap, what, now + self.cache.ttl)
                raise _limit_exceeded(cap, what)

    def _refuse_if_at_cap(self, user_id: int, caps: tuple[Cap, Cap]) -> None:
        """Refuse a new identifier of an account found at a cap within the last ``cache.ttl``
        seconds (and whose caps are the same), without the account's lock or its count: a flood of
        invented identifiers costs the database one read each, not a locked count."""
        at_cap = self._at_cap.get(user_id)
        if at_cap is None:
            return
        if at_cap.caps == caps and time.monotonic() < at_cap.until:
            raise _limit_exceeded(at_cap.cap, at_cap.what)
        del self._at_cap[user_id]

    async def _fill(self, session: AsyncSession, repo: EndUserRepository, found: FoundEndUser) -> FoundEndUser:
        """Give a known end user an ID of every length in use it lacks (a key version of a new length)."""
        held = {(m.bits, m.block_bits) for m in found.message_ids}
        lengths = [
            p for p in (await lengths_in_use(session, self._configured)).params if (p.bits, p.block_bits) not in held
        ]
        ids = MessageIdRepository(session)
        now = datetime.now(UTC)
        for _ in range(MAX_ALLOCATION_ATTEMPTS):
            messages = await choose_message_ids(ids, lengths, self._allocator)
            rows = [
                {
                    "end_user_id": found.row.id,
                    "bits": m.params.bits,
                    "block_bits": m.params.block_bits,
                    "message_id": m.bits,
                    "created_at": now,
                }
                for m in messages
            ]
            await ids.insert_if_free(rows)
            assert found.row.identifier is not None  # found by its identifier
            refreshed = await repo.find(found.row.user_id, found.row.identifier)
            assert refreshed is not None
            if all(
                any((m.bits, m.block_bits) == (p.bits, p.block_bits) for m in refreshed.message_ids) for p in lengths
            ):
                if self._on_change is not None:
                    self._on_change()
                return refreshed
        raise ConflictError("Could not allocate a unique message ID; retry the request", code="message_id_conflict")
