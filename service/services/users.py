"""User registry: creation with fresh message IDs, listing, status changes, tombstones.

Message-ID rule: a new user gets one message ID per message length in use (the lengths of the
non-retired key versions plus the configured one, see ``services/message_ids.py``). Each is
allocated by ``xmark_core.allocate_message`` against every message ID of its length ever stored
(deleted users included), so IDs are never reused and stay far apart in Hamming distance.
``users.message_id`` keeps the one of the configured length. The unique constraints on
``message_ids`` (and ``users.message_id``) guard concurrent creations; a violation re-reads the
IDs and allocates again.

Last active admin: every change that can take an active admin away (disable, delete, a role
change) holds the admins' guard lock (``repositories/guards.py``) before it reads the user and
counts, so concurrent changes are decided one after the other and at least one active admin
always remains.

Every change is recorded in the registry's audit trail (``services/audit.py``) by the writer the
service is given, in the same unit of work; a call that changes nothing records nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.exc import IntegrityError

from service.errors import ConflictError, NotFoundError
from service.models import ApiKey, MessageId, User
from service.repositories.guards import Guard, lock_guarded_set
from service.repositories.message_ids import MessageIdRepository
from service.repositories.unit import Repositories
from service.schemas.admin import LIMIT_FIELDS, CreatedUser, UserOut, UserPage
from service.schemas.common import MessageIdOut
from service.security import ApiKeyHasher, ParsedKey, generate_api_key
from service.services.audit import UNRECORDED, AuditWriter, Change, api_key_ref, user_created
from service.services.auth_cache import AuthCache
from service.services.message_ids import MessageLength, lengths_in_use, message_ids_out
from service.vocabulary import AuditAction, AuditTarget, Role, UserStatus
from xmark_core import Message, MessageSpaceExhausted, WatermarkParams, allocate_message
from xmark_core.encoders import KeyVersionSpec

logger = logging.getLogger("xmark.users")

Allocator = Callable[[Iterable[str], WatermarkParams], Message]
MAX_ALLOCATION_ATTEMPTS = 5
# Past this many message-ID rows (and above 16 bits), a new ID is drawn uniformly among the unallocated
# ones instead of the best of several candidates far from every allocated ID: reading and scoring
# every ID would cost each creation seconds at 10^6 users, and among that many IDs the spread gains
# about a bit of distance. The unique constraints refuse a taken ID, and the creation draws again.
SPREAD_ALLOCATION_LIMIT = 100_000
SPREAD_MIN_BITS = 17


def message_id_of(user: User, ids: Iterable[MessageIdOut], length: MessageLength) -> str:
    """The user's ID of ``length``; the one it was created with if it has none of that length."""
    return next((m.message_id for m in ids if (m.bits, m.block_bits) == length), user.message_id)


def user_out(user: User, rows: Iterable[MessageId], encoding: MessageLength) -> UserOut:
    """``encoding``: the length the active key version encodes with (``message_id`` is of it)."""
    ids = message_ids_out(rows)
    return UserOut(
        id=user.id,
        name=user.name,
        role=Role(user.role),
        status=UserStatus(user.status),
        message_id=message_id_of(user, ids, encoding),
        message_ids=ids,
        max_parallel_requests=user.max_parallel_requests,
        requests_per_minute=user.requests_per_minute,
        tokens_per_minute=user.tokens_per_minute,
        end_users_max=user.end_users_max,
        end_users_new_per_minute=user.end_users_new_per_minute,
        end_user_requests_per_minute=user.end_user_requests_per_minute,
        end_user_tokens_per_minute=user.end_user_tokens_per_minute,
        created_at=user.created_at,
        updated_at=user.updated_at,
        deleted_at=user.deleted_at,
    )


def allocate_one(existing: Iterable[str], params: WatermarkParams) -> Message:
    """The registry's allocation rule for one new ID: ``xmark_core.allocate_message``."""
    return allocate_message(existing, params)


async def choose_message_ids(
    ids: MessageIdRepository, lengths: Sequence[WatermarkParams], allocator: Allocator = allocate_one
) -> list[Message]:
    """One new message ID per length in ``lengths``, for a new user or end user: each drawn far from
    every ID of its length ever allocated (users', end users' and tombstones'), or uniformly past
    ``SPREAD_ALLOCATION_LIMIT`` rows; the unique constraints on ``message_ids`` refuse one taken
    concurrently (the caller then draws again). 409 when a length's space is exhausted."""
    messages: list[Message] = []
    large = await ids.newest_row() >= SPREAD_ALLOCATION_LIMIT
    for params in lengths:
        if large and params.bits >= SPREAD_MIN_BITS:
            existing: list[str] = []  # drawn at random: the unique constraints check it
        else:
            existing = await ids.existing(params.bits, params.block_bits)
        try:
            messages.append(allocator(existing, params))
        except MessageSpaceExhausted:
            raise ConflictError(
                f"The {params.bits}-bit message-ID space is exhausted; no more users can be registered",
                code="message_space_exhausted",
            ) from None
    return messages


class UserService:
    def __init__(
        self,
        repos: Repositories,
        params: WatermarkParams | KeyVersionSpec,
        hasher: ApiKeyHasher,
        *,
        allocator: Allocator = allocate_one,
        on_change: Callable[[], None] | None = None,
        auth_cache: AuthCache | None = None,
        audit: AuditWriter = UNRECORDED,
    ) -> None:
        self._session = repos.session
        self._audit = audit
        self._params = params
        self._hasher = hasher
        self._allocator = allocator
        self._on_change = on_change
        self._auth_cache = auth_cache
        self._users = repos.users
        self._keys = repos.api_keys
        self._ids = repos.message_ids

    async def create_user(
        self,
        name: str,
        role: Role,
        *,
        api_key: ParsedKey | None = None,
        limits: Mapping[str, int | None] | None = None,
    ) -> CreatedUser:
        """Create a user with fresh message IDs and one API key (shown once in the result).

        ``limits``: the user's admission limits (``LIMIT_FIELDS``; None or absent: the default).
        """
        user, rows, encoding = await self._insert_with_message_ids(name, role, dict(limits or {}))
        key = api_key or generate_api_key()
        row = await self._keys.add(ApiKey(user_id=user.id, prefix=key.prefix, key_hash=self._hasher.hash(key)))
        await self._audit.record(self._session, user_created(user, rows, row))
        self._changed()
        logger.info("user created", extra={"user_id": user.id, "role": role, "api_key_id": row.id})
        ids = message_ids_out(rows)
        return CreatedUser(
            id=user.id,
            name=user.name,
            role=role,
            message_id=message_id_of(user, ids, encoding),
            message_ids=ids,
            max_parallel_requests=user.max_parallel_requests,
            requests_per_minute=user.requests_per_minute,
            tokens_per_minute=user.tokens_per_minute,
            api_key=key.plaintext,
        )

    async def _insert_with_message_ids(
        self, name: str, role: Role, limits: dict[str, int | None]
    ) -> tuple[User, list[MessageId], MessageLength]:
        """Insert the user with one fresh message ID per length in use (and the encoding length)."""
        lengths = await lengths_in_use(self._session, self._params)
        for _ in range(MAX_ALLOCATION_ATTEMPTS):
            messages = await choose_message_ids(self._ids, lengths.params, self._allocator)
            now = datetime.now(UTC)
            configured = messages[0]  # lengths.params[0] is the configured length
            user = User(
                name=name,
                role=role,
                status=UserStatus.ACTIVE,
                message_id=configured.bits,
                created_at=now,
                updated_at=now,
                **{field: limits.get(field) for field in LIMIT_FIELDS},
            )
            try:
                async with self._session.begin_nested():
                    await self._users.add(user)
                    rows = [
                        MessageId(
                            user_id=user.id,
                            bits=m.params.bits,
                            block_bits=m.params.block_bits,
                            message_id=m.bits,
                            created_at=now,
                        )
                        for m in messages
                    ]
                    await self._ids.add_all(rows)
            except IntegrityError:
                # a concurrent creation took one of these IDs between our read and our insert
                logger.info("message ID taken concurrently; allocating again")
                continue
            return user, rows, lengths.encoding
        raise ConflictError(
            "Could not allocate a unique message ID; retry the request",
            code="message_id_conflict",
        )

    async def _out(self, user: User) -> UserOut:
        encoding = (await lengths_in_use(self._session, self._params)).encoding
        return user_out(user, await self._ids.of_user(user.id), encoding)

    async def get_user(self, user_id: int) -> UserOut:
        return await self._out(await self._require(user_id))

    async def list_users(
        self,
        *,
        limit: int,
        offset: int,
        status: str | None = None,
        role: str | None = None,
        q: str | None = None,
        after_id: int | None = None,
    ) -> UserPage:
        rows, total = await self._users.page(
            limit=limit, offset=offset, status=status, role=role, name_contains=q, after_id=after_id
        )
        encoding = (await lengths_in_use(self._session, self._params)).encoding
        ids = await self._ids.of_users(u.id for u in rows)
        return UserPage.of([user_out(u, ids[u.id], encoding) for u in rows], total=total, limit=limit, offset=offset)

    async def disable_user(self, user_id: int) -> UserOut:
        user = await self._require_guarded(user_id)
        if user.status == UserStatus.DELETED:
            raise ConflictError("A deleted user cannot be disabled", code="user_deleted")
        if user.status == UserStatus.ACTIVE:
            await self._guard_last_admin(user)
            user.status = UserStatus.DISABLED
            user.updated_at = datetime.now(UTC)
            await self._users.flush()
            await self._record(AuditAction.USER_DISABLE, user, {"status": UserStatus.ACTIVE}, {"status": user.status})
            self._changed()
            self._forget_credentials(user.id)
            logger.info("user disabled", extra={"user_id": user.id})
        return await self._out(user)

    async def enable_user(self, user_id: int) -> UserOut:
        user = await self._require(user_id, for_update=True)
        if user.status == UserStatus.DELETED:
            raise ConflictError("A deleted user cannot be enabled", code="user_deleted")
        if user.status == UserStatus.DISABLED:
            user.status = UserStatus.ACTIVE
            user.updated_at = datetime.now(UTC)
            await self._users.flush()
            await self._record(AuditAction.USER_ENABLE, user, {"status": UserStatus.DISABLED}, {"status": user.status})
            self._changed()
            self._forget_credentials(user.id)
            logger.info("user enabled", extra={"user_id": user.id})
        return await self._out(user)

    async def delete_user(self, user_id: int) -> UserOut:
        """Tombstone: status deleted, every key revoked, row and message ID kept forever."""
        user = await self._require_guarded(user_id)
        if user.status != UserStatus.DELETED:
            if user.status == UserStatus.ACTIVE:
                await self._guard_last_admin(user)
            before = {"status": user.status}
            now = datetime.now(UTC)
            user.status = UserStatus.DELETED
            user.deleted_at = now
            user.updated_at = now
            revoked = await self._keys.revoke_all_for_user(user.id, now)
            await self._users.flush()
            after = {"status": user.status, "deleted_at": now, "revoked_api_keys": [api_key_ref(*k) for k in revoked]}
            await self._record(AuditAction.USER_DELETE, user, before, after)
            self._changed()
            self._forget_credentials(user.id)
            logger.info("user deleted", extra={"user_id": user.id})
        return await self._out(user)

    async def update_user(self, user_id: int, changes: Mapping[str, Any]) -> UserOut:
        """Change a user's name, role, admission limits or end-user limits (``changes``: only the
        fields to change), recorded in the audit trail as the changed fields' old and new values.

        A limit set to None goes back to the gateway's default. Taking the admin role from the
        last active admin is refused. The user's cached authentications are dropped, so the next
        request (to this process; other replicas within the cache's TTL) sees the new values.
        """
        user = await self._require_guarded(user_id)
        if user.status == UserStatus.DELETED:
            raise ConflictError("A deleted user cannot be changed", code="user_deleted")
        role = changes.get("role")
        if role is not None and role != user.role and user.status == UserStatus.ACTIVE:
            await self._guard_last_admin(user)
        updated = {field: value for field, value in changes.items() if getattr(user, field) != value}
        if updated:
            before = {field: getattr(user, field) for field in updated}
            for field, value in updated.items():
                setattr(user, field, value)
            user.updated_at = datetime.now(UTC)
            await self._users.flush()
            await self._record(AuditAction.USER_UPDATE, user, before, updated)
            if "name" in updated or "role" in updated:
                self._changed()
            self._forget_credentials(user.id)
            logger.info("user updated", extra={"user_id": user.id, "fields": sorted(updated)})
        return await self._out(user)

    async def _record(
        self, action: AuditAction, user: User, before: Mapping[str, Any], after: Mapping[str, Any]
    ) -> None:
        await self._audit.record(self._session, Change(action, AuditTarget.USER, user.id, before, after))

    def _changed(self) -> None:
        """Tell registry caches that the set of users changed."""
        if self._on_change is not None:
            self._on_change()

    def _forget_credentials(self, user_id: int) -> None:
        """Drop the cached authentications of ``user_id`` (now, and again when this change commits).

        Every change of a user's status or role must call this, so the change takes effect on the
        next request to this process.
        """
        if self._auth_cache is not None:
            self._auth_cache.invalidate_user(user_id, self._session)

    async def _guard_last_admin(self, user: User) -> None:
        """Refuse to take ``user`` (active) from the active admins when it is the last one.

        Only valid under the admins' guard lock (``_require_guarded``).
        """
        if user.role == Role.ADMIN and await self._users.count_active_admins() <= 1:
            raise ConflictError(
                "The last active admin cannot be disabled, deleted or given another role", code="last_admin"
            )

    async def _require_guarded(self, user_id: int) -> User:
        """The user, locked, read after taking the admins' guard lock (held until the transaction ends)."""
        await lock_guarded_set(self._session, Guard.ACTIVE_ADMINS)
        return await self._require(user_id, for_update=True)

    async def _require(self, user_id: int, *, for_update: bool = False) -> User:
        user = await (self._users.get_for_update(user_id) if for_update else self._users.get(user_id))
        if user is None:
            raise NotFoundError(f"User {user_id} not found", param="user_id")
        return user
