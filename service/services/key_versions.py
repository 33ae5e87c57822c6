"""Key-version administration: list, activate (add) and retire.

Activating a version of a message length some users have no ID of gives every user one first
(``services/message_ids.py``), in the same unit of work: once the activation commits, every user
can be encoded under it. End users get theirs in the same unit of work up to one batch
(``BACKFILL_BATCH``) and, past that, in the background once the activation has committed
(``EndUserDirectory.ids_added``, the ``on_end_user_ids`` hook): there may be far more of them than fit
one request's transaction, and a request of one not yet reached gets its ID on that request.

Last active key version: retiring takes the key versions' guard lock (``repositories/guards.py``)
before it reads the version and counts the active ones, so two retirements racing for the last
two active versions are decided one after the other and one of them is refused.

Activations and retirements are recorded in the registry's audit trail (``services/audit.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import event

from service.config import ConfigurationError, Settings, generate_embedded_secret
from service.errors import ConflictError, InvalidRequestError, NotFoundError
from service.keyring import Keyring, row_spec
from service.models import KeyVersion
from service.repositories.guards import Guard, lock_guarded_set
from service.repositories.unit import Repositories
from service.schemas.admin import CompanionEncoderOut, KeyVersionList, KeyVersionOut
from service.services.audit import UNRECORDED, AuditWriter, Change, key_version_fields
from service.services.auth_cache import AuthCache
from service.services.message_ids import MessageIdService
from service.vocabulary import AuditAction, AuditTarget, KeyVersionStatus

logger = logging.getLogger("xmark.key_versions")


def _companion_out(row: KeyVersion) -> CompanionEncoderOut | None:
    companion = row_spec(row).companion
    if companion is None or row.companion_fingerprint is None:
        return None
    return CompanionEncoderOut(
        scheme=companion.scheme,
        block_bits=companion.block_bits,
        num_keys=companion.num_keys,
        delta=companion.delta,
        min_entropy=companion.min_entropy,
        fingerprint=row.companion_fingerprint,
    )


class KeyVersionService:
    def __init__(
        self,
        repos: Repositories,
        keyring: Keyring,
        settings: Settings,
        *,
        can_generate: bool,
        auth_cache: AuthCache | None = None,
        audit: AuditWriter = UNRECORDED,
        on_end_user_ids: Callable[[bool], object] | None = None,
    ) -> None:
        # runs once an activation that gave end users IDs, or left some without, has committed:
        # with whether end users are left (``EndUserDirectory.ids_added``: its cache, the backfill)
        self._on_end_user_ids = on_end_user_ids
        self._repos = repos
        self._session = repos.session
        self._audit = audit
        self._keyring = keyring
        self._settings = settings
        self._can_generate = can_generate
        self._auth_cache = auth_cache
        self._repo = repos.key_versions

    def _out(self, row: KeyVersion) -> KeyVersionOut:
        return KeyVersionOut(
            id=row.id,
            name=row.name,
            status=KeyVersionStatus(row.status),
            bits=row.bits,
            block_bits=row.block_bits,
            num_keys=row.num_keys,
            delta=row.delta,
            scheme=row.scheme,
            min_entropy=row.min_entropy,
            salts=row.salts,
            fingerprint=row.fingerprint,
            companion=_companion_out(row),
            configured=self._keyring.is_configured(row.name),
            created_at=row.created_at,
            activated_at=row.activated_at,
            retired_at=row.retired_at,
        )

    async def list_versions(self) -> KeyVersionList:
        return KeyVersionList(data=[self._out(r) for r in await self._repo.list_all()])

    async def activate(self, name: str) -> KeyVersionOut:
        """Make ``name`` the encoding version; its secret must be configured (or, embedded, generated).

        Holds the key versions' guard lock too: concurrent activations of one name, or an
        activation beside a retirement, are decided one after the other.
        """
        await lock_guarded_set(self._session, Guard.ACTIVE_KEY_VERSIONS)
        row = await self._repo.get_by_name(name)
        if row is not None and row.status == KeyVersionStatus.ACTIVE:
            raise ConflictError(f"Key version '{name}' is already active", param="name")
        if row is not None and row.status == KeyVersionStatus.RETIRED:
            raise ConflictError(
                f"Key version '{name}' is retired and cannot be reactivated; use a new name",
                param="name",
            )
        if not self._keyring.is_configured(name):
            if not self._can_generate:
                raise InvalidRequestError(
                    f"No secret is configured for key version '{name}': add it to the watermark "
                    "secrets of every replica and restart them first",
                    param="name",
                    code="secret_not_configured",
                )
            try:
                secret = generate_embedded_secret(self._settings, name)
            except ConfigurationError as exc:
                raise InvalidRequestError(str(exc), param="name") from None
            self._keyring.add_secret(name, secret)
        now = datetime.now(UTC)
        before = None if row is None else {"status": row.status}
        if row is None:
            row, inserted = await self._keyring.register(self._session, name, KeyVersionStatus.ACTIVE)
            before = None if inserted else {"status": row.status}  # registered by another replica meanwhile
        if row.status != KeyVersionStatus.ACTIVE:
            row.status = KeyVersionStatus.ACTIVE
            row.activated_at = now
            await self._repo.flush()
        # every user (deleted ones included) needs an ID of this version's length; usually they got
        # it when the version was registered at start-up, and this finds nobody missing
        ids = MessageIdService(self._repos)
        added = await ids.fill(row_spec(row).encoders)
        if added and self._auth_cache is not None:  # cached principals lack the new IDs
            self._auth_cache.invalidate_all(self._session)
        # end users: a first batch here (all of a small directory), the rest in the background
        end_users_added, more = await ids.fill_end_users_first(row_spec(row).encoders)
        after = {
            **key_version_fields(row),
            "message_ids_added": added,
            "end_user_message_ids_added": end_users_added,
        }
        change = Change(AuditAction.KEY_VERSION_ACTIVATE, AuditTarget.KEY_VERSION, row.id, before, after)
        await self._audit.record(self._session, change)
        await self._keyring.refresh(self._session)
        if (end_users_added or more) and self._on_end_user_ids is not None:
            # after the commit (the backfill's own sessions must see the version): the end-user
            # cache, whose identities lack the new IDs, and the end users the first batch left
            loop, hook = asyncio.get_running_loop(), self._on_end_user_ids
            event.listen(self._session.sync_session, "after_commit", lambda _: loop.call_soon(hook, more), once=True)
        logger.info("key version activated", extra={"key_version": name})
        return self._out(row)

    async def retire(self, version_id: int) -> KeyVersionOut:
        await lock_guarded_set(self._session, Guard.ACTIVE_KEY_VERSIONS)
        row = await self._repo.get(version_id, for_update=True)
        if row is None:
            raise NotFoundError(f"Key version {version_id} not found", param="key_version_id")
        if row.status == KeyVersionStatus.RETIRED:
            raise ConflictError(f"Key version '{row.name}' is already retired")
        if row.status == KeyVersionStatus.ACTIVE and await self._repo.count_active() <= 1:
            raise ConflictError(
                "The last active key version cannot be retired; activate another one first",
                code="last_active_key_version",
            )
        before = {"name": row.name, "status": row.status}
        row.status = KeyVersionStatus.RETIRED
        row.retired_at = datetime.now(UTC)
        await self._repo.flush()
        after = {"name": row.name, "status": row.status, "retired_at": row.retired_at}
        await self._audit.record(
            self._session, Change(AuditAction.KEY_VERSION_RETIRE, AuditTarget.KEY_VERSION, row.id, before, after)
        )
        await self._keyring.refresh(self._session)
        logger.info("key version retired", extra={"key_version": row.name})
        return self._out(row)
