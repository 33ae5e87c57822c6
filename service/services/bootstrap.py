"""First-admin bootstrap: used at start-up (XMARK_BOOTSTRAP_ADMIN_KEY) and by `xmark create-admin`."""

from __future__ import annotations

import logging

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from service.repositories.users import UserRepository
from service.schemas.admin import CreatedUser
from service.security import ApiKeyHasher, ParsedKey
from service.services.users import UserService
from service.vocabulary import Role
from xmark_core import WatermarkParams

logger = logging.getLogger("xmark.bootstrap")

DEFAULT_ADMIN_NAME = "admin"


async def has_active_admin(session: AsyncSession) -> bool:
    return await UserRepository(session).count_active_admins() > 0


async def ensure_first_admin(
    session: AsyncSession,
    params: WatermarkParams,
    hasher: ApiKeyHasher,
    *,
    api_key: ParsedKey | None = None,
    name: str = DEFAULT_ADMIN_NAME,
) -> CreatedUser | None:
    """Create an admin when none is active; None when one already exists.

    With ``api_key`` the admin gets that key (bootstrap key); otherwise a fresh key is generated
    and returned once in the result.
    """
    if await has_active_admin(session):
        return None
    try:
        async with session.begin_nested():
            created = await UserService(session, params, hasher).create_user(name, Role.ADMIN, api_key=api_key)
    except IntegrityError:
        # another process bootstrapped the same key concurrently
        logger.info("first admin created concurrently elsewhere")
        return None
    logger.info("first admin created", extra={"user_id": created.id})
    return created
