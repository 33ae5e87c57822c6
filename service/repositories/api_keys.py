"""Queries over the api_keys table."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql import Executable

from service.models import ApiKey, MessageId, User
from service.vocabulary import Role, UserStatus

# Everything authentication needs about the keys of one display prefix, in one statement: each key
# (usually exactly one) with its user and one row per message ID of the user (a user without any
# still has a row, its message ID columns NULL), keys by id, lengths shortest first. Built once: a
# statement built per call costs more to match against the compiled cache than to run.
_PRINCIPAL_ROWS = (
    select(
        ApiKey.id.label("key_id"),
        ApiKey.key_hash,
        ApiKey.revoked_at,
        ApiKey.last_used_at,
        User.id.label("user_id"),
        User.name,
        User.role,
        User.status,
        User.max_parallel_requests,
        User.requests_per_minute,
        User.tokens_per_minute,
        User.end_users_max,
        User.end_users_new_per_minute,
        User.end_user_requests_per_minute,
        User.end_user_tokens_per_minute,
        MessageId.bits,
        MessageId.block_bits,
        MessageId.message_id,
    )
    .join(User, User.id == ApiKey.user_id)
    .outerjoin(MessageId, MessageId.user_id == User.id)
    .where(ApiKey.prefix == bindparam("prefix"))
    .order_by(ApiKey.id, MessageId.bits, MessageId.block_bits)
)


def principal_rows(prefix: str) -> tuple[Executable, dict[str, str]]:
    """The statement and parameters of the authentication read of the keys with display ``prefix``."""
    return _PRINCIPAL_ROWS, {"prefix": prefix}


class ApiKeyRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def add(self, key: ApiKey) -> ApiKey:
        self._session.add(key)
        await self._session.flush()
        return key

    async def get(self, user_id: int, key_id: int) -> ApiKey | None:
        stmt = select(ApiKey).where(ApiKey.id == key_id, ApiKey.user_id == user_id)
        return (await self._session.execute(stmt)).scalar_one_or_none()

    async def list_for_user(self, user_id: int) -> Sequence[ApiKey]:
        stmt = select(ApiKey).where(ApiKey.user_id == user_id).order_by(ApiKey.id)
        return (await self._session.scalars(stmt)).all()

    async def page_by_prefix(
        self, prefix: str, *, user_id: int | None, limit: int, offset: int
    ) -> tuple[Sequence[ApiKey], int]:
        """Keys whose display prefix starts with ``prefix`` (exactly, case-sensitive on every
        backend), of one user or of all, oldest first."""
        filters = [func.substr(ApiKey.prefix, 1, len(prefix)) == prefix] if prefix else []
        if user_id is not None:
            filters.append(ApiKey.user_id == user_id)
        rows = await self._session.scalars(
            select(ApiKey).where(*filters).order_by(ApiKey.id).limit(limit).offset(offset)
        )
        total = await self._session.scalar(select(func.count()).select_from(ApiKey).where(*filters))
        return rows.all(), int(total or 0)

    async def candidates(self, prefix: str) -> Sequence[tuple[ApiKey, User]]:
        """Keys sharing a display prefix, each with its user (usually exactly one)."""
        stmt = (
            select(ApiKey, User)
            .join(User, User.id == ApiKey.user_id)
            .where(ApiKey.prefix == prefix)
            .order_by(ApiKey.id)
        )
        return [(key, user) for key, user in (await self._session.execute(stmt)).all()]

    async def count_live_admin_keys(self) -> int:
        """Unrevoked keys of active admins: the keys the admin API can still be reached with."""
        stmt = (
            select(func.count())
            .select_from(ApiKey)
            .join(User, User.id == ApiKey.user_id)
            .where(ApiKey.revoked_at.is_(None), User.role == Role.ADMIN, User.status == UserStatus.ACTIVE)
        )
        return int(await self._session.scalar(stmt) or 0)

    async def revoke_all_for_user(self, user_id: int, when: datetime) -> list[tuple[int, str]]:
        """Revoke the user's unrevoked keys; the (id, display prefix) of each key revoked, by id."""
        stmt = (
            update(ApiKey)
            .where(ApiKey.user_id == user_id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=when)
            .returning(ApiKey.id, ApiKey.prefix)
            .execution_options(synchronize_session=False)
        )
        return sorted((int(key_id), str(prefix)) for key_id, prefix in (await self._session.execute(stmt)).all())

    async def flush(self) -> None:
        await self._session.flush()
