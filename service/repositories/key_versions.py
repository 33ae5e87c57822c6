"""Queries over the key_versions table (parameters and fingerprints only, never secrets)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import KeyVersion
from service.vocabulary import KeyVersionStatus


class KeyVersionRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def list_all(self) -> Sequence[KeyVersion]:
        return (await self._session.scalars(select(KeyVersion).order_by(KeyVersion.id))).all()

    async def in_use(self) -> Sequence[KeyVersion]:
        """Every version that is not retired (pending ones included)."""
        stmt = select(KeyVersion).where(KeyVersion.status != KeyVersionStatus.RETIRED).order_by(KeyVersion.id)
        return (await self._session.scalars(stmt)).all()

    async def get(self, version_id: int, *, for_update: bool = False) -> KeyVersion | None:
        """``for_update``: read the newest committed row and lock it (not the session's cached copy)."""
        if for_update:
            stmt = select(KeyVersion).where(KeyVersion.id == version_id).with_for_update()
            return (await self._session.execute(stmt)).scalar_one_or_none()
        return await self._session.get(KeyVersion, version_id)

    async def get_by_name(self, name: str) -> KeyVersion | None:
        stmt = select(KeyVersion).where(KeyVersion.name == name)
        return (await self._session.execute(stmt)).scalar_one_or_none()

    async def add(self, version: KeyVersion) -> KeyVersion:
        self._session.add(version)
        await self._session.flush()
        return version

    async def count_active(self) -> int:
        stmt = select(func.count()).select_from(KeyVersion).where(KeyVersion.status == KeyVersionStatus.ACTIVE)
        return int(await self._session.scalar(stmt) or 0)

    async def flush(self) -> None:
        await self._session.flush()
