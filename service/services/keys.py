"""API keys: issue (plaintext shown once), list (prefix only), revoke, authenticate."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Row

from service.errors import AuthenticationError, ConflictError, NotFoundError, PermissionDeniedError
from service.models import ApiKey
from service.repositories.guards import Guard, lock_guarded_set
from service.repositories.unit import Repositories
from service.schemas.admin import ApiKeyList, ApiKeyOut, ApiKeyPage, IssuedKey
from service.schemas.common import MessageIdOut, Principal
from service.security import ApiKeyFormatError, ApiKeyHasher, ParsedKey, generate_api_key, parse_api_key
from service.services.audit import UNRECORDED, AuditWriter, Change
from service.vocabulary import AuditAction, AuditTarget, Role, UserStatus

if TYPE_CHECKING:
    from service.services.auth_cache import AuthCache
    from service.services.last_use import LastUseRecorder

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


def parse_bearer(authorization: str | None) -> ParsedKey:
    """The well-formed key of an ``Authorization: Bearer <key>`` header (401 otherwise; no database)."""
    if not authorization or not authorization.strip():
        raise _unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
    try:
        return parse_api_key(token.strip())
    except ApiKeyFormatError:
        raise _unauthorized("Invalid API key") from None


def parse_api_key_headers(x_api_key: str | None, authorization: str | None) -> ParsedKey:
    """The well-formed key of a request that may send it as Anthropic's clients do,
    ``x-api-key: <key>``, or as a bearer token (401 otherwise; no database). Both may be sent only
    if they hold the same key."""
    if x_api_key is None or not x_api_key.strip():
        if not authorization or not authorization.strip():
            raise _unauthorized("Missing API key: send it as 'x-api-key: <key>' or 'Authorization: Bearer <key>'")
        return parse_bearer(authorization)
    try:
        key = parse_api_key(x_api_key.strip())
    except ApiKeyFormatError:
        raise _unauthorized("Invalid API key") from None
    if authorization and authorization.strip():
        bearer = parse_bearer(authorization)
        if not hmac.compare_digest(bearer.plaintext.encode(), key.plaintext.encode()):
            raise _unauthorized("The x-api-key and Authorization headers hold different keys; send one")
    return key


def principal_from_rows(rows: Sequence[Row[Any]], key_hash: str) -> tuple[Principal, datetime | None]:
    """The principal of a well-formed key, and when its use was last written, from the rows of
    ``service.repositories.api_keys.principal_rows`` for its prefix: 401 unknown or revoked, 403
    user disabled or deleted. Every candidate's hash is compared in constant time."""
    matched = [row for row in rows if hmac.compare_digest(key_hash, row.key_hash)]
    if not matched:
        raise _unauthorized("Invalid API key")
    first = matched[0]
    if first.revoked_at is not None:
        raise _unauthorized("This API key has been revoked")
    if first.status == UserStatus.DISABLED:
        raise PermissionDeniedError("This user is disabled", code="user_disabled")
    if first.status != UserStatus.ACTIVE:
        raise PermissionDeniedError("This user has been deleted", code="user_deleted")
    principal = Principal(
        user_id=first.user_id,
        name=first.name,
        role=Role(first.role),
        api_key_id=first.key_id,
        message_ids=tuple(
            MessageIdOut(bits=row.bits, block_bits=row.block_bits, message_id=row.message_id)
            for row in matched
            if row.message_id is not None
        ),
        max_parallel_requests=first.max_parallel_requests,
        requests_per_minute=first.requests_per_minute,
        tokens_per_minute=first.tokens_per_minute,
        end_users_max=first.end_users_max,
        end_users_new_per_minute=first.end_users_new_per_minute,
        end_user_requests_per_minute=first.end_user_requests_per_minute,
        end_user_tokens_per_minute=first.end_user_tokens_per_minute,
    )
    return principal, first.last_used_at


def touch_due(last_used_at: datetime | None, now: datetime) -> bool:
    """Whether a use at ``now`` must be written (``last_used_at`` has a resolution of a minute)."""
    return last_used_at is None or now - last_used_at >= LAST_USED_RESOLUTION


class ApiKeyService:
    def __init__(
        self,
        repos: Repositories,
        hasher: ApiKeyHasher,
        *,
        auth_cache: AuthCache | None = None,
        last_use: LastUseRecorder | None = None,
        audit: AuditWriter = UNRECORDED,
    ) -> None:
        self._session = repos.session
        self._audit = audit
        self._hasher = hasher
        self._keys = repos.api_keys
        self._users = repos.users
        self._auth_cache = auth_cache
        self._last_use = last_use  # its pending uses are written before keys are listed

    async def _uses_written(self) -> None:
        if self._last_use is not None:
            await self._last_use.flush()

    async def issue_key(self, user_id: int) -> IssuedKey:
        user = await self._users.get(user_id)
        if user is None:
            raise NotFoundError(f"User {user_id} not found", param="user_id")
        if user.status == UserStatus.DELETED:
            raise ConflictError("A deleted user cannot receive keys", code="user_deleted")
        key = generate_api_key()
        row = await self._keys.add(ApiKey(user_id=user.id, prefix=key.prefix, key_hash=self._hasher.hash(key)))
        issued = Change(
            AuditAction.API_KEY_ISSUE, AuditTarget.API_KEY, row.id, None, {"user_id": user.id, "prefix": key.prefix}
        )
        await self._audit.record(self._session, issued)
        logger.info("api key issued", extra={"user_id": user.id, "api_key_id": row.id})
        return IssuedKey(id=row.id, api_key=key.plaintext, prefix=row.prefix, created_at=row.created_at)

    async def list_keys(self, user_id: int) -> ApiKeyList:
        if await self._users.get(user_id) is None:
            raise NotFoundError(f"User {user_id} not found", param="user_id")
        await self._uses_written()
        return ApiKeyList(data=[key_out(k) for k in await self._keys.list_for_user(user_id)])

    async def find_keys(self, prefix: str, *, user_id: int | None, limit: int, offset: int) -> ApiKeyPage:
        """Keys across users by the start of their display prefix (e.g. one seen in a log),
        optionally of one user."""
        await self._uses_written()
        rows, total = await self._keys.page_by_prefix(prefix, user_id=user_id, limit=limit, offset=offset)
        return ApiKeyPage.of([key_out(k) for k in rows], total=total, limit=limit, offset=offset)

    async def revoke_key(self, user_id: int, key_id: int) -> ApiKeyOut:
        """Revoke a key; the last unrevoked key of the active admins is refused (409 ``last_admin_key``),
        as taking the last active admin away is: nobody could reach the admin API afterwards."""
        # the admins' guard first (before the row is read), so two admins revoking each other's last
        # keys at once cannot both pass the count (service.repositories.guards)
        await lock_guarded_set(self._session, Guard.ACTIVE_ADMINS)
        key = await self._keys.get(user_id, key_id)
        if key is None:
            raise NotFoundError(f"API key {key_id} of user {user_id} not found", param="key_id")
        if key.revoked_at is None:
            user = await self._users.get(user_id)
            if (
                user is not None
                and user.role == Role.ADMIN
                and user.status == UserStatus.ACTIVE
                and await self._keys.count_live_admin_keys() <= 1
            ):
                raise ConflictError(
                    "The last API key of the active admins cannot be revoked; issue another admin key first",
                    code="last_admin_key",
                )
            key.revoked_at = datetime.now(UTC)
            await self._keys.flush()
            named = {"user_id": key.user_id, "prefix": key.prefix}
            change = Change(
                AuditAction.API_KEY_REVOKE,
                AuditTarget.API_KEY,
                key.id,
                {**named, "revoked_at": None},
                {**named, "revoked_at": key.revoked_at},
            )
            await self._audit.record(self._session, change)
            if self._auth_cache is not None:
                self._auth_cache.invalidate_key(key.id, self._session)
            logger.info("api key revoked", extra={"user_id": user_id, "api_key_id": key.id})
        return key_out(key)
