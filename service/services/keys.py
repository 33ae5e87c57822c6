"""API keys: issue (plaintext shown once), list (prefix only), revoke, authenticate."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.db import session_scope

from service.errors import AuthenticationError, ConflictError, NotFoundError, PermissionDeniedError
from service.models import ApiKey
from service.repositories.api_keys import ApiKeyRepository
from service.repositories.users import UserRepository
from service.schemas.admin import ApiKeyList, ApiKeyOut, IssuedKey
from service.schemas.common import Principal
from service.security import ApiKeyFormatError, ApiKeyHasher, generate_api_key, parse_api_key

logger = logging.getLogger("xmark.keys")

LAST_USED_RESOLUTION = timedelta(minutes=1)
_AUTH_HEADERS = {"WWW-Authenticate": "Bearer"}


def key_out(key: ApiKey) -> ApiKeyOut:
    return ApiKeyOut(
        id=key.id,
        user_id=key.user_id,
        prefix=key.prefix,
        created_at=key.created_at,
        last_used_at=key.last_used_at,
        revoked_at=key.revoked_at,
    )


def _unauthorized(message: str) -> AuthenticationError:
    return AuthenticationError(message, headers=_AUTH_HEADERS)


class ApiKeyService:
    def __init__(
        self,
        session: AsyncSession,
        hasher: ApiKeyHasher,
        usage_sessionmaker: async_sessionmaker[AsyncSession] | None = None,
    ) -> None:
        self._hasher = hasher
        self._keys = ApiKeyRepository(session)
        self._users = UserRepository(session)
        # last_used_at is bookkeeping: written in its own short unit of work when a sessionmaker is
        # given, so the row lock is not held for the whole request (a long stream would otherwise
        # make every concurrent request with the same key wait, and SQLite's single writer too).
        self._usage_sessionmaker = usage_sessionmaker

    async def issue_key(self, user_id: int) -> IssuedKey:
        user = await self._users.get(user_id)
        if user is None:
            raise NotFoundError(f"User {user_id} not found", param="user_id")
        if user.status == "deleted":
            raise ConflictError("A deleted user cannot receive keys", code="user_deleted")
        key = generate_api_key()
        row = await self._keys.add(
            ApiKey(user_id=user.id, prefix=key.prefix, key_hash=self._hasher.hash(key))
        )
        logger.info("api key issued", extra={"user_id": user.id, "api_key_id": row.id})
        return IssuedKey(id=row.id, api_key=key.plaintext, prefix=row.prefix, created_at=row.created_at)

    async def list_keys(self, user_id: int) -> ApiKeyList:
        if await self._users.get(user_id) is None:
            raise NotFoundError(f"User {user_id} not found", param="user_id")
        return ApiKeyList(data=[key_out(k) for k in await self._keys.list_for_user(user_id)])

    async def revoke_key(self, user_id: int, key_id: int) -> ApiKeyOut:
        key = await self._keys.get(user_id, key_id)
        if key is None:
            raise NotFoundError(f"API key {key_id} of user {user_id} not found", param="key_id")
        if key.revoked_at is None:
            key.revoked_at = datetime.now(UTC)
            await self._keys.flush()
            logger.info("api key revoked", extra={"user_id": user_id, "api_key_id": key.id})
        return key_out(key)

    async def authenticate(self, authorization: str | None) -> Principal:
        """Resolve an ``Authorization: Bearer <key>`` header to the calling principal."""
        if not authorization or not authorization.strip():
            raise _unauthorized(
                "Missing API key: send it as 'Authorization: Bearer <key>'"
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
        try:
            parsed = parse_api_key(token.strip())
        except ApiKeyFormatError:
            raise _unauthorized("Invalid API key") from None
        match = None
        for key, user in await self._keys.candidates(parsed.prefix):
            if self._hasher.matches(parsed, key.key_hash):
                match = (key, user)
        if match is None:
            raise _unauthorized("Invalid API key")
        key, user = match
        if key.revoked_at is not None:
            raise _unauthorized("This API key has been revoked")
        if user.status == "disabled":
            raise PermissionDeniedError("This user is disabled", code="user_disabled")
        if user.status != "active":
            raise PermissionDeniedError("This user has been deleted", code="user_deleted")
        now = datetime.now(UTC)
        if key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION:
            if self._usage_sessionmaker is None:
                await self._keys.touch(key.id, now)
            else:
                async with session_scope(self._usage_sessionmaker) as usage:
                    await ApiKeyRepository(usage).touch(key.id, now)
        return Principal(
            user_id=user.id,
            name=user.name,
            role=user.role,  # type: ignore[arg-type]
            message_id=user.message_id,
            api_key_id=key.id,
        )
