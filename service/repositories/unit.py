"""The repositories of one database session, handed to the services that work in it.

A service never builds a repository: the route's dependency (``service.deps.RepositoriesDep``),
the CLI or a test opens a session, wraps it in :class:`Repositories` and passes that on, so the
service's data access is what its caller chose (one session and transaction for everything a
request does; a test may give repositories over any session). Each repository is made on first
use and shared by every service the same ``Repositories`` is given to. The services commit
through :attr:`Repositories.session`; the repositories flush, never commit.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession

from service.end_users.repository import EndUserRepository
from service.repositories.api_keys import ApiKeyRepository
from service.repositories.audit import AuditRepository
from service.repositories.key_versions import KeyVersionRepository
from service.repositories.message_ids import MessageIdRepository
from service.repositories.planner import PlannerStatistics
from service.repositories.traces import TraceRepository
from service.repositories.usage import UsageRepository
from service.repositories.users import UserRepository

if TYPE_CHECKING:
    from service.repositories.provenance import ProvenanceRepository

__all__ = ["Repositories"]


class Repositories:
    """One session's repositories (``planner``: the provenance search's planner statistics, shared
    by the process; None: the search plans without them)."""

    def __init__(self, session: AsyncSession, *, planner: PlannerStatistics | None = None) -> None:
        self.session = session
        self._planner = planner

    @cached_property
    def users(self) -> UserRepository:
        return UserRepository(self.session)

    @cached_property
    def api_keys(self) -> ApiKeyRepository:
        return ApiKeyRepository(self.session)

    @cached_property
    def message_ids(self) -> MessageIdRepository:
        return MessageIdRepository(self.session)

    @cached_property
    def key_versions(self) -> KeyVersionRepository:
        return KeyVersionRepository(self.session)

    @cached_property
    def usage(self) -> UsageRepository:
        return UsageRepository(self.session)

    @cached_property
    def audit(self) -> AuditRepository:
        return AuditRepository(self.session)

    @cached_property
    def end_users(self) -> EndUserRepository:
        return EndUserRepository(self.session)

    @cached_property
    def traces(self) -> TraceRepository:
        return TraceRepository(self.session)

    @cached_property
    def provenance(self) -> ProvenanceRepository:
        # imported here: the chat path (which builds repositories too) imports no trace module
        from service.repositories.provenance import ProvenanceRepository

        return ProvenanceRepository(self.session, self._planner)
