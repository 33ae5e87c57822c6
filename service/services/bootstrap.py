"""First-admin bootstrap: used at start-up (XMARK_BOOTSTRAP_ADMIN_KEY) and by `xmark create-admin`."""

from __future__ import annotations

import hmac
import logging

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from service.repositories.api_keys import ApiKeyRepository
from service.repositories.guards import Guard, lock_guarded_set
from service.repositories.unit import Repositories
from service.repositories.users import UserRepository
from service.schemas.admin import CreatedUser
from service.security import ApiKeyHasher, ParsedKey
from service.services.audit import AuditWriter
from service.services.users import UserService
from service.vocabulary import Role
from xmark_core import WatermarkParams
from xmark_core.encoders import KeyVersionSpec

logger = logging.getLogger("xmark.bootstrap")

DEFAULT_ADMIN_NAME = "admin"


async def has_active_admin(session: AsyncSession) -> bool:
    return await UserRepository(session).count_active_admins() > 0


async def _key_is_taken(session: AsyncSession, key: ParsedKey, key_hash: str) -> bool:
    """Whether ``key`` is stored already (e.g. the bootstrap key of an admin since disabled or deleted)."""
    return any(
        hmac.compare_digest(key_hash, k.key_hash) for k, _ in await ApiKeyRepository(session).candidates(key.prefix)
    )


async def ensure_first_admin(
    session: AsyncSession,
    params: WatermarkParams | KeyVersionSpec,
    hasher: ApiKeyHasher,
    *,
    audit: AuditWriter,
    api_key: ParsedKey | None = None,
    name: str = DEFAULT_ADMIN_NAME,
    fresh_key_if_taken: bool = False,
) -> CreatedUser | None:
    """Create an admin when no *active* admin exists; None when one does.

    With ``api_key`` the admin gets that key (bootstrap key); otherwise a fresh key is generated
    and returned once in the result. The bootstrap key may still belong to the first admin after
    it was disabled or deleted (a key is never reused): then, with ``fresh_key_if_taken``, the new
    admin gets a fresh key instead (``xmark create-admin --if-none``, whose operator sees it);
    without it nothing is created and a warning says what to do (at start-up nobody would see the
    key). Holds the admins' guard lock, so concurrent bootstraps create one admin. The creation is
    recorded by ``audit`` (the system at start-up, the CLI for `xmark create-admin`).
    """
    await lock_guarded_set(session, Guard.ACTIVE_ADMINS)
    if await has_active_admin(session):
        return None
    if api_key is not None and await _key_is_taken(session, api_key, hasher.hash(api_key)):
        if not fresh_key_if_taken:
            logger.warning(
                "no active admin, and XMARK_BOOTSTRAP_ADMIN_KEY belongs to a disabled or deleted user: "
                "run `xmark create-admin --if-none` to create an admin with a fresh key"
            )
            return None
        logger.info("the bootstrap key belongs to a disabled or deleted user; the new admin gets a fresh key")
        api_key = None
    try:
        async with session.begin_nested():
            users = UserService(Repositories(session), params, hasher, audit=audit)
            created = await users.create_user(name, Role.ADMIN, api_key=api_key)
    except IntegrityError:
        # another process bootstrapped the same key concurrently
        logger.info("first admin created concurrently elsewhere")
        return None
    logger.info("first admin created", extra={"user_id": created.id})
    return created
