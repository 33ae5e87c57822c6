"""Watermark key versions: configured secrets joined with the key_versions table.

A key version is a named secret plus watermark parameters. The secret lives only in the
configuration (or, embedded, in ``var/``); the table stores the name, the parameters, the
fingerprint and the status:

* ``active``  — may encode; the newest active version encodes new generations;
* ``pending`` — configured and registered, not yet used to encode (activate via the admin API);
* ``retired`` — no longer encodes and is no longer tried by /trace.

On start-up :meth:`Keyring.sync` registers configured secrets that have no row (the first one
becomes active on an empty table, later ones pending) and checks that every configured secret
matches the fingerprint stored for its name; a mismatch stops the start-up.

New rows get the configured parameters (:func:`spec_from_settings`); existing rows keep the
parameters stored with them (:func:`row_spec`), message length included: versions of different
message lengths coexist, and each user holds a message ID of every length in use
(``services/message_ids.py``).

A version of the configured scheme ``auto`` carries two encoders (``xmark_core.encoders``): its
primary (distortion-free) and its biasing companion, each with its own parameters, derived key and
fingerprint, both stored with the row and both checked against the configured secret. A handle
holds both; :meth:`Keyring.readings` gives one handle per encoder, what ``/trace`` reads a text under.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from service.config import Settings
from service.errors import ServiceUnavailableError
from service.exceptions import ServiceError
from service.models import KeyVersion
from service.repositories.key_versions import KeyVersionRepository
from service.vocabulary import KeyVersionStatus
from xmark_core import WatermarkKey, WatermarkParams, warm_null_cache
from xmark_core.encoders import KeyVersionSpec, as_spec, companion_key
from xmark_core.params import Scheme

logger = logging.getLogger("xmark.keyring")


class KeyringError(ServiceError):
    """The configured secrets and the key_versions table disagree (start-up error)."""


@dataclass(frozen=True)
class KeyVersionHandle:
    """A usable key version: its row id, name, derived key and status; ``companion``: the key of
    its biasing encoder (a per-request version), else None. A handle of one encoder
    (:meth:`encoders`) has ``key`` set to that encoder's key and ``is_companion`` telling which."""

    id: int
    name: str
    key: WatermarkKey
    status: KeyVersionStatus
    companion: WatermarkKey | None = None
    is_companion: bool = False

    @property
    def per_request(self) -> bool:
        """Whether the version carries two encoders, one chosen per request."""
        return self.companion is not None

    @property
    def encoder(self) -> str:
        """The scheme of this handle's encoder (``key``): what a generation record and a report name."""
        return self.key.params.scheme

    def encoders(self) -> tuple[KeyVersionHandle, ...]:
        """One handle per encoder of the version, primary first; each has no companion of its own."""
        if self.companion is None:
            return (self,)
        return (replace(self, companion=None), replace(self, key=self.companion, companion=None, is_companion=True))


@dataclass(frozen=True)
class _RowView:
    id: int
    name: str
    status: KeyVersionStatus
    spec: KeyVersionSpec
    fingerprint: str
    companion_fingerprint: str | None
    activated_at: datetime | None


def spec_from_settings(settings: Settings) -> KeyVersionSpec:
    """The encoders of new key versions, as configured."""
    return settings.watermark_spec()


def params_from_settings(settings: Settings) -> WatermarkParams:
    """The primary encoder's parameters of new key versions, as configured."""
    return spec_from_settings(settings).primary


def row_params(row: KeyVersion) -> WatermarkParams:
    """The primary encoder's parameters stored with a key version."""
    return WatermarkParams(
        bits=row.bits,
        block_bits=row.block_bits,
        num_keys=row.num_keys,
        delta=row.delta,
        scheme=cast("Scheme", row.scheme),  # WatermarkParams checks it is one of the schemes
        min_entropy=row.min_entropy,
        salts=row.salts,
    )


def row_spec(row: KeyVersion) -> KeyVersionSpec:
    """Every encoder's parameters stored with a key version (the companion's, if it has one)."""
    if row.companion_scheme is None:
        return KeyVersionSpec(row_params(row))
    companion = WatermarkParams(
        bits=row.bits,
        block_bits=int(row.companion_block_bits or 0),
        num_keys=int(row.companion_num_keys or 0),
        delta=float(row.companion_delta or 0.0),
        scheme=cast("Scheme", row.companion_scheme),
        min_entropy=float(row.companion_min_entropy or 0.0),
    )
    return KeyVersionSpec(row_params(row), companion)


class Keyring:
    """In-memory view of the usable key versions of this process."""

    def __init__(self, params: WatermarkParams | KeyVersionSpec, secrets: Mapping[str, bytes]) -> None:
        self._spec = as_spec(params)
        self._params = self._spec.primary
        self._secrets = dict(secrets)
        self._keys: dict[tuple[str, WatermarkParams, bool], WatermarkKey] = {}
        self._handles: tuple[KeyVersionHandle, ...] = ()
        self._mismatched: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"Keyring(versions={[h.name for h in self._handles]!r})"

    @property
    def params(self) -> WatermarkParams:
        """The primary encoder's parameters of new key versions; existing ones keep their own (``row_spec``)."""
        return self._params

    @property
    def spec(self) -> KeyVersionSpec:
        """Every encoder's parameters of new key versions."""
        return self._spec

    def lengths(self) -> frozenset[tuple[int, int]]:
        """The message lengths (bits, block_bits) of the usable versions' encoders."""
        return frozenset((h.key.params.bits, h.key.params.block_bits) for h in self.readings())

    def is_configured(self, name: str) -> bool:
        return name in self._secrets

    def add_secret(self, name: str, secret: bytes) -> None:
        """Register a secret created at run time (embedded mode)."""
        self._secrets[name] = secret

    def key_for(self, name: str, params: WatermarkParams, *, companion: bool = False) -> WatermarkKey:
        """The watermark key derived from the configured secret of ``name``: the version's primary
        encoder's, or with ``companion`` its biasing companion's (``xmark_core.encoders.companion_key``)."""
        cache_key = (name, params, companion)
        key = self._keys.get(cache_key)
        if key is None:
            secret = self._secrets[name]
            key = companion_key(secret, params) if companion else WatermarkKey.from_secret(secret, params)
            self._keys[cache_key] = key
        return key

    def active(self) -> KeyVersionHandle:
        """The newest active version; it encodes new generations."""
        for handle in self._handles:
            if handle.status == KeyVersionStatus.ACTIVE:
                return handle
        raise ServiceUnavailableError("No active watermark key version is configured")

    def usable(self) -> list[KeyVersionHandle]:
        """Every non-retired version whose secret is configured, newest first."""
        return list(self._handles)

    def readings(self) -> list[KeyVersionHandle]:
        """One handle per encoder of every usable version (``KeyVersionHandle.encoders``), newest
        version first: what ``/trace`` reads a text under, each one test of its count."""
        return [encoder for handle in self._handles for encoder in handle.encoders()]

    def handle(self, version_id: int) -> KeyVersionHandle | None:
        return next((h for h in self._handles if h.id == version_id), None)

    async def sync(self, session: AsyncSession) -> list[KeyVersion]:
        """Start-up: register configured secrets, verify fingerprints, load the usable versions.
        Returns the rows this call inserted (for the registry's audit trail)."""
        repo = KeyVersionRepository(session)
        rows = {row.name: row for row in await repo.list_all()}
        has_active = any(row.status == KeyVersionStatus.ACTIVE for row in rows.values())
        registered: list[KeyVersion] = []
        for name in self._secrets:
            row = rows.get(name)
            if row is None:
                row, inserted = await self._register(
                    session, repo, name, KeyVersionStatus.PENDING if has_active else KeyVersionStatus.ACTIVE
                )
                rows[name] = row
                if inserted:
                    registered.append(row)
            self._verify(row)
            has_active = has_active or row.status == KeyVersionStatus.ACTIVE
        await self._load(repo, strict=True)
        newest = next((v for v in self._views(await repo.list_all()) if v.status == KeyVersionStatus.ACTIVE), None)
        if not any(h.status == KeyVersionStatus.ACTIVE for h in self._handles):
            raise KeyringError(
                "no active key version has a configured secret; configure the secret of an "
                "active version or activate a configured one"
            )
        if newest is not None and newest.name not in self._secrets:
            logger.warning(
                "the newest active key version is not configured here",
                extra={"key_version": newest.name},
            )
        if newest is not None and newest.spec.primary.bits != self._params.bits:
            # an upgrade across a change of the default length: the version keeps its own, and vLLM
            # workers, which encode with the configured parameters, refuse its requests by fingerprint
            logger.warning(
                "the active key version's message length differs from XMARK_WATERMARK_BITS; vLLM workers "
                "must be given the active version's length until a version of the configured one is activated",
                extra={
                    "key_version": newest.name,
                    "active_bits": newest.spec.primary.bits,
                    "configured_bits": self._params.bits,
                },
            )
        return registered

    async def refresh(self, session: AsyncSession) -> None:
        """Reload the table (after an admin change, or periodically on every replica)."""
        await self._load(KeyVersionRepository(session), strict=False)

    async def register(self, session: AsyncSession, name: str, status: KeyVersionStatus) -> tuple[KeyVersion, bool]:
        """Insert the row of a configured secret (used by activation); the row, and whether this
        call inserted it (False: another replica registered it concurrently)."""
        return await self._register(session, KeyVersionRepository(session), name, status)

    async def _register(
        self, session: AsyncSession, repo: KeyVersionRepository, name: str, status: KeyVersionStatus
    ) -> tuple[KeyVersion, bool]:
        key = self.key_for(name, self._params)
        companion = self._spec.companion
        now = datetime.now(UTC)
        row = KeyVersion(
            name=name,
            bits=self._params.bits,
            block_bits=self._params.block_bits,
            num_keys=self._params.num_keys,
            delta=self._params.delta,
            scheme=self._params.scheme,
            min_entropy=self._params.min_entropy,
            salts=self._params.salts,
            fingerprint=key.fingerprint,
            companion_scheme=None if companion is None else companion.scheme,
            companion_block_bits=None if companion is None else companion.block_bits,
            companion_num_keys=None if companion is None else companion.num_keys,
            companion_delta=None if companion is None else companion.delta,
            companion_min_entropy=None if companion is None else companion.min_entropy,
            companion_fingerprint=None
            if companion is None
            else self.key_for(name, companion, companion=True).fingerprint,
            status=status,
            created_at=now,
            activated_at=now if status == KeyVersionStatus.ACTIVE else None,
        )
        try:
            async with session.begin_nested():
                await repo.add(row)
        except IntegrityError:
            # another replica registered the same name concurrently: use its row
            existing = await repo.get_by_name(name)
            if existing is None:
                raise
            return existing, False
        logger.info("key version registered", extra={"key_version": name, "status": status})
        return row, True

    def _matches(self, name: str, spec: KeyVersionSpec, fingerprint: str, companion_fingerprint: str | None) -> bool:
        """Whether the configured secret of ``name`` gives the stored fingerprint of every encoder."""
        if self.key_for(name, spec.primary).fingerprint != fingerprint:
            return False
        if spec.companion is None:
            return companion_fingerprint is None
        return self.key_for(name, spec.companion, companion=True).fingerprint == companion_fingerprint

    def _verify(self, row: KeyVersion) -> None:
        spec = row_spec(row)  # its own parameters, whatever the configured ones are now
        if not self._matches(row.name, spec, row.fingerprint, row.companion_fingerprint):
            raise KeyringError(
                f"the configured secret of key version {row.name!r} does not match its stored "
                f"fingerprint {row.fingerprint[:12]}…; restore the original secret or configure "
                "the new one under a new key version name"
            )

    def _views(self, rows: Sequence[KeyVersion]) -> list[_RowView]:
        views = [
            _RowView(
                id=row.id,
                name=row.name,
                status=KeyVersionStatus(row.status),
                spec=row_spec(row),
                fingerprint=row.fingerprint,
                companion_fingerprint=row.companion_fingerprint,
                activated_at=row.activated_at,
            )
            for row in rows
        ]
        # newest first: most recently activated, then most recently created
        views.sort(key=lambda v: (v.activated_at or datetime.min.replace(tzinfo=UTC), v.id), reverse=True)
        return views

    async def _load(self, repo: KeyVersionRepository, *, strict: bool) -> None:
        handles: list[KeyVersionHandle] = []
        mismatched: set[str] = set()
        for view in self._views(await repo.list_all()):
            if view.status == KeyVersionStatus.RETIRED or view.name not in self._secrets:
                continue
            if not self._matches(view.name, view.spec, view.fingerprint, view.companion_fingerprint):
                if strict:
                    raise KeyringError(
                        f"the configured secret of key version {view.name!r} does not match its stored fingerprint"
                    )
                mismatched.add(view.name)
                continue
            key = self.key_for(view.name, view.spec.primary)
            companion = view.spec.companion
            handles.append(
                KeyVersionHandle(
                    id=view.id,
                    name=view.name,
                    key=key,
                    status=view.status,
                    companion=None if companion is None else self.key_for(view.name, companion, companion=True),
                )
            )
        if mismatched - self._mismatched:
            logger.error(
                "configured secrets do not match stored key versions; they are not used",
                extra={"key_versions": ",".join(sorted(mismatched))},
            )
        self._mismatched = frozenset(mismatched)
        # pending versions are tried by /trace (no text carries them yet, so they cost nothing
        # but time) but never encode: order active ones first for clarity.
        handles.sort(key=lambda h: h.status != KeyVersionStatus.ACTIVE)
        self._handles = tuple(handles)


async def prepare_null_distributions(keyring: Keyring, max_row_tokens: int) -> None:
    """Simulate the per-row null distributions that /trace's test needs, for rows of 1 to
    ``max_row_tokens`` tokens and the parameters of every usable key version.

    Each row size is simulated once per process and cached; without
    this, the first traces after start-up pay for it inline. Runs on a worker thread, one row
    size at a time, so it can be cancelled between sizes and the event loop keeps serving.
    """
    started = time.perf_counter()
    done: list[object] = []
    try:
        for handle in keyring.readings():
            params = handle.key.params
            if params in done:
                continue
            done.append(params)
            for n in range(1, max_row_tokens + 1):
                await asyncio.to_thread(warm_null_cache, params, n, min_row_tokens=n)
    except Exception as exc:  # traces still work: they simulate what they need on first use
        logger.warning("preparing trace null distributions failed", extra={"error_type": type(exc).__name__})
        return
    seconds = round(time.perf_counter() - started, 1)
    logger.info(
        "trace null distributions ready",
        extra={"row_tokens": max_row_tokens, "parameter_sets": len(done), "seconds": seconds},
    )
