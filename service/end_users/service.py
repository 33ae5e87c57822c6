"""The admin side of end users: listing an account's end users with their limits and usage,
changing an end user's own rate limits, disabling, enabling, deleting.

Every change is recorded in the registry's audit trail by the writer the service is given, in the
same unit of work; a call that changes nothing records nothing. A change drops the end user from
this process's directory cache now and when it commits (other replicas: within the cache's TTL).
Deleting is a tombstone: the row and its message IDs stay, its texts keep tracing, and its
identifier cannot name a new end user of the account.

An end user as served carries the limits its requests are held to (its own, else the account's
end-user limits, else the settings') and its usage over the last ``USAGE_WINDOW`` (one statement
per page, on an index of the end users' generation records).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from service.config import Settings
from service.end_users.directory import EndUserCache
from service.end_users.schemas import EndUserLimits, EndUserOut, EndUserPage, EndUserUsage
from service.errors import ConflictError, NotFoundError
from service.models import EndUser, MessageId, User
from service.repositories.unit import Repositories
from service.services.admission import limit_of
from service.services.audit import UNRECORDED, AuditWriter, Change
from service.services.message_ids import message_ids_out
from service.vocabulary import AuditAction, AuditTarget, EndUserStatus

logger = logging.getLogger("xmark.end_users")

USAGE_WINDOW = timedelta(hours=24)


def effective_limits(row: EndUser, account: User, settings: Settings) -> EndUserLimits:
    """The limits the end user's requests are held to (as admission computes them)."""
    return EndUserLimits(
        requests_per_minute=limit_of(
            row.requests_per_minute,
            account.end_user_requests_per_minute,
            default=settings.end_user_requests_per_minute,
        ),
        tokens_per_minute=limit_of(
            row.tokens_per_minute, account.end_user_tokens_per_minute, default=settings.end_user_tokens_per_minute
        ),
    )


def end_user_out(
    row: EndUser, message_ids: Sequence[MessageId], limits: EndUserLimits, usage: EndUserUsage
) -> EndUserOut:
    assert row.identifier is not None, "the repository lists end users, not slot rows"
    return EndUserOut(
        id=row.id,
        user_id=row.user_id,
        identifier=row.identifier,
        status=EndUserStatus(row.status),
        message_ids=message_ids_out(message_ids),
        created_at=row.created_at,
        last_seen_at=row.last_seen_at,
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        limits=limits,
        usage=usage,
    )


class EndUserService:
    def __init__(
        self,
        repos: Repositories,
        *,
        settings: Settings,
        cache: EndUserCache | None = None,
        on_change: Callable[[], None] | None = None,
        audit: AuditWriter = UNRECORDED,
    ) -> None:
        self._session = repos.session
        self._settings = settings
        self._repo = repos.end_users
        self._cache = cache
        self._on_change = on_change
        self._audit = audit

    async def list_end_users(
        self, user_id: int, *, limit: int, offset: int, q: str | None = None, status: str | None = None
    ) -> EndUserPage:
        account = await self._require_account(user_id)
        rows, total = await self._repo.page(user_id, limit=limit, offset=offset, q=q, status=status)
        return EndUserPage.of(await self._outs(account, rows), total=total, limit=limit, offset=offset)

    async def update(self, user_id: int, end_user_id: int, changes: Mapping[str, Any]) -> EndUserOut:
        """Change the end user's own rate limits (``changes``: only the fields to change; None goes
        back to the account's end-user limit), recorded in the audit trail as ``end_user.update``
        with the changed fields' old and new values. 409 for a deleted end user."""
        account, row = await self._require(user_id, end_user_id)
        if row.status == EndUserStatus.DELETED:
            raise ConflictError("A deleted end user cannot be changed", code="end_user_deleted")
        updated = {field: value for field, value in changes.items() if getattr(row, field) != value}
        if updated:
            before = {field: getattr(row, field) for field in updated}
            for field, value in updated.items():
                setattr(row, field, value)
            await self._repo.flush()
            after = {**updated, "user_id": row.user_id, "identifier": row.identifier}
            await self._audit.record(
                self._session, Change(AuditAction.END_USER_UPDATE, AuditTarget.END_USER, row.id, before, after)
            )
            if self._cache is not None:
                self._cache.invalidate(row.id, self._session)
            logger.info("end user updated", extra={"user_id": row.user_id, "end_user_id": row.id})
        return await self._out(account, row)

    async def disable(self, user_id: int, end_user_id: int) -> EndUserOut:
        return await self._set_status(
            user_id, end_user_id, EndUserStatus.DISABLED, AuditAction.END_USER_DISABLE, frm=EndUserStatus.ACTIVE
        )

    async def enable(self, user_id: int, end_user_id: int) -> EndUserOut:
        return await self._set_status(
            user_id, end_user_id, EndUserStatus.ACTIVE, AuditAction.END_USER_ENABLE, frm=EndUserStatus.DISABLED
        )

    async def delete(self, user_id: int, end_user_id: int) -> EndUserOut:
        """Tombstone: status deleted; the row and its message IDs are kept forever."""
        account, row = await self._require(user_id, end_user_id)
        if row.status != EndUserStatus.DELETED:
            await self._change(row, EndUserStatus.DELETED, AuditAction.END_USER_DELETE)
        return await self._out(account, row)

    async def _set_status(
        self, user_id: int, end_user_id: int, status: EndUserStatus, action: AuditAction, *, frm: EndUserStatus
    ) -> EndUserOut:
        account, row = await self._require(user_id, end_user_id)
        if row.status == EndUserStatus.DELETED:
            raise ConflictError("A deleted end user cannot be changed", code="end_user_deleted")
        if row.status == frm:
            await self._change(row, status, action)
        return await self._out(account, row)

    async def _change(self, row: EndUser, status: EndUserStatus, action: AuditAction) -> None:
        before: Mapping[str, Any] = {"status": row.status}
        row.status = status
        await self._repo.flush()
        after = {"status": status, "user_id": row.user_id, "identifier": row.identifier}
        await self._audit.record(self._session, Change(action, AuditTarget.END_USER, row.id, before, after))
        if self._cache is not None:
            self._cache.invalidate(row.id, self._session)
        if self._on_change is not None:
            self._on_change()
        logger.info(f"end user {status}", extra={"user_id": row.user_id, "end_user_id": row.id})

    async def _outs(self, account: User, rows: Sequence[EndUser]) -> list[EndUserOut]:
        ids = await self._repo.message_ids_of([row.id for row in rows])
        since = datetime.now(UTC) - USAGE_WINDOW
        usage = await self._repo.usage([row.id for row in rows], since)
        return [
            end_user_out(
                row,
                ids[row.id],
                effective_limits(row, account, self._settings),
                EndUserUsage(since=since, requests=usage[row.id][0], tokens=usage[row.id][1]),
            )
            for row in rows
        ]

    async def _out(self, account: User, row: EndUser) -> EndUserOut:
        return (await self._outs(account, [row]))[0]

    async def _require_account(self, user_id: int) -> User:
        account = await self._session.get(User, user_id)
        if account is None:
            raise NotFoundError(f"User {user_id} not found", param="user_id")
        return account

    async def _require(self, user_id: int, end_user_id: int) -> tuple[User, EndUser]:
        account = await self._require_account(user_id)
        row = await self._repo.get(user_id, end_user_id, for_update=True)
        if row is None:
            raise NotFoundError(f"End user {end_user_id} of user {user_id} not found", param="end_user_id")
        return account, row
