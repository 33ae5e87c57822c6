"""The registry's audit trail: every change to users, API keys, key versions and message IDs,
appended in the unit of work of the change, hash-chained and signed.

An entry is written by :meth:`AuditTrail.record` in the caller's session, after the change's own
writes: it commits with the change or not at all, and when it cannot be written the change fails.
Its fields (:func:`entry_payload`): ``seq`` (1, 2, 3, … without gaps), ``created_at``, the actor
(``api`` with the acting user's id and name, ``cli`` or ``system``), the action and target, the
changed fields before and after, the request's X-Request-ID (null for the CLI and start-up), the
previous entry's hash (:data:`GENESIS_HASH` for the first) and the signing key's id.
``entry_hash`` is the SHA-256 of the canonical JSON of those fields (RFC 8785,
``services/reports.canonical_json``) and ``signature`` the gateway's Ed25519 signature of the same
bytes, by the key that signs trace reports. The entry as the API serves it is that payload plus
``entry_hash`` and ``signature``: anyone holding the public key can check a saved page.

Appends take turns on the head row (``repositories/audit.py``), held from the append until the
change commits, so two changes at once never fork the chain. The append is the last write of a
change: it never waits for a lock while holding the head.

:class:`ChainVerifier` checks a trail entry by entry (``xmark verify-audit``): each entry's hash and
signature (an entry altered), its number and predecessor (an entry removed), and at the end the head
row against the last entry (entries removed from the end).

``changes`` never holds a key, a key's hash, a secret or a fingerprint of one: a key is named by its
id and display prefix; :meth:`AuditTrail.record` refuses a value that looks like an API key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Literal, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.ext.asyncio import AsyncSession

from service.errors import GatewayError
from service.keyring import row_spec
from service.models import ApiKey, KeyVersion, MessageId, RegistryAuditEntry, User
from service.repositories.audit import AuditRepository
from service.security import KEY_PATTERN
from service.services.reports import ReportSigner, canonical_json, iso_utc, key_id_of
from service.vocabulary import AuditAction, AuditActorKind, AuditTarget, KeyVersionStatus
from xmark_core import WatermarkParams

logger = logging.getLogger("xmark.audit")

# the prev_hash of the first entry, and the head's hash while the trail is empty (migration 0012)
GENESIS_HASH = "0" * 64
SIGNATURE_ALG = "Ed25519"
# the fields of an entry that are not part of its signed payload
UNSIGNED_FIELDS = ("entry_hash", "signature")

BreakKind = Literal["altered", "removed", "truncated"]


class AuditTrailError(GatewayError):
    """The entry of a change could not be written: the change is refused and rolled back."""

    status_code = 500
    type = "server_error"
    code = "audit_trail_unavailable"


@dataclass(frozen=True)
class Actor:
    """Who makes a change: ``api`` (the authenticated user), ``cli`` or ``system`` (start-up)."""

    kind: AuditActorKind
    user_id: int | None = None
    name: str | None = None

    @classmethod
    def api(cls, user_id: int, name: str) -> Actor:
        return cls(AuditActorKind.API, user_id, name)


CLI_ACTOR = Actor(AuditActorKind.CLI)
SYSTEM_ACTOR = Actor(AuditActorKind.SYSTEM)


@dataclass(frozen=True)
class Change:
    """One change to the registry: what was done to which row, and its changed fields before and
    after (None: the row did not exist before, or does not after)."""

    action: AuditAction
    target: AuditTarget
    target_id: int | str
    before: Mapping[str, Any] | None = None
    after: Mapping[str, Any] | None = None


class AuditWriter(Protocol):
    """What the registry's services record their changes with."""

    async def record(self, session: AsyncSession, change: Change) -> None: ...


class _Unrecorded:
    """Records nothing: for seeding a registry in tests and benchmarks only. Every route, command
    and start-up write passes an :class:`AuditTrail`."""

    async def record(self, session: AsyncSession, change: Change) -> None:
        return None


UNRECORDED: AuditWriter = _Unrecorded()


def _jsonable(value: Any) -> Any:
    """``value`` as JSON values: timestamps as the reports write them, enums by value."""
    if isinstance(value, datetime):
        return iso_utc(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise AuditTrailError(f"A change holds a value the audit trail cannot record ({type(value).__name__})")


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def entry_payload(row: RegistryAuditEntry) -> dict[str, Any]:
    """The signed fields of an entry, as the API serves them (without ``entry_hash`` and ``signature``)."""
    return {
        "seq": int(row.seq),
        "created_at": iso_utc(row.created_at),
        "actor": {"kind": row.actor_kind, "user_id": row.actor_user_id, "name": row.actor_name},
        "action": row.action,
        "target": {"type": row.target_type, "id": row.target_id},
        "changes": row.changes,
        "request_id": row.request_id,
        "prev_hash": row.prev_hash,
        "key_id": row.signing_key_id,
    }


def stored_entry(row: RegistryAuditEntry) -> dict[str, Any]:
    """An entry as stored: its payload, ``entry_hash`` and ``signature``."""
    return {**entry_payload(row), "entry_hash": row.entry_hash, "signature": row.signature}


def entry_hash(payload: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the payload's canonical JSON."""
    return hashlib.sha256(canonical_json(payload)).hexdigest()


@dataclass(frozen=True)
class AuditTrail:
    """Appends the changes of one actor (and, through the API, one request) to the trail, signed by
    ``signer`` (the gateway's report signing key)."""

    signer: ReportSigner
    actor: Actor
    request_id: str | None = None

    async def record(self, session: AsyncSession, change: Change) -> None:
        """Append ``change`` in ``session``'s unit of work (it commits or rolls back with the change).
        Call it after the change's own writes."""
        changes = _jsonable({"before": change.before, "after": change.after})
        if any(KEY_PATTERN.search(text) for text in _strings(changes)):
            raise AuditTrailError("A change to record holds an API key; nothing was changed")
        repo = AuditRepository(session)
        head = await repo.advance_head()
        if head is None:
            logger.error("the audit trail's head row is missing; registry changes are refused")
            raise AuditTrailError("The audit trail cannot be written (its head row is missing); nothing was changed")
        seq, prev_hash = head
        row = RegistryAuditEntry(
            seq=seq,
            # the stored and the signed time agree to the microsecond on every backend
            created_at=datetime.now(UTC),
            actor_kind=self.actor.kind.value,
            actor_user_id=self.actor.user_id,
            actor_name=self.actor.name,
            action=change.action.value,
            target_type=change.target.value,
            target_id=str(change.target_id),
            changes=changes,
            request_id=self.request_id,
            prev_hash=prev_hash,
            signing_key_id=self.signer.key_id,
        )
        payload = entry_payload(row)
        row.entry_hash = entry_hash(payload)
        row.signature = self.signer.sign(payload)
        await repo.append(row)


# --- what each change records ------------------------------------------------------------------


def api_key_ref(key_id: int, prefix: str) -> dict[str, Any]:
    """How the trail names a key: its id and display prefix, never the key or its hash."""
    return {"id": key_id, "prefix": prefix}


def user_created(user: User, message_ids: Sequence[MessageId], key: ApiKey) -> Change:
    after = {
        "name": user.name,
        "role": user.role,
        "status": user.status,
        "message_ids": [
            {"bits": m.bits, "block_bits": m.block_bits, "message_id": m.message_id}
            for m in sorted(message_ids, key=lambda m: (m.bits, m.block_bits))
        ],
        "max_parallel_requests": user.max_parallel_requests,
        "requests_per_minute": user.requests_per_minute,
        "tokens_per_minute": user.tokens_per_minute,
        "api_key": api_key_ref(key.id, key.prefix),
    }
    return Change(AuditAction.USER_CREATE, AuditTarget.USER, user.id, None, after)


def key_version_fields(row: KeyVersion) -> dict[str, Any]:
    """A key version's name, status and encoders' parameters (never its fingerprints)."""
    spec = row_spec(row)

    def params(p: WatermarkParams) -> dict[str, Any]:
        return {
            "scheme": p.scheme,
            "bits": p.bits,
            "block_bits": p.block_bits,
            "num_keys": p.num_keys,
            "delta": p.delta,
            "min_entropy": p.min_entropy,
            "salts": p.salts,
        }

    return {
        "name": row.name,
        "status": row.status,
        "params": params(spec.primary),
        "companion": None if spec.companion is None else params(spec.companion),
        "activated_at": row.activated_at,
    }


def key_version_registered(row: KeyVersion) -> Change:
    """A configured secret's row, inserted at start-up: active (the first) or pending."""
    active = row.status == KeyVersionStatus.ACTIVE
    action = AuditAction.KEY_VERSION_ACTIVATE if active else AuditAction.KEY_VERSION_REGISTER
    return Change(action, AuditTarget.KEY_VERSION, row.id, None, key_version_fields(row))


def message_ids_allocated(
    params: WatermarkParams, allocated: int, ids: tuple[int, int], *, end_users: bool = False
) -> Change:
    """IDs of a length given to users (or, ``end_users``, to end users) that had none (a batch of a
    backfill); those given one by id range (``user_ids`` or ``end_user_ids``)."""
    length = f"{params.bits}/{params.block_bits}"
    after = {
        "bits": params.bits,
        "block_bits": params.block_bits,
        "allocated": allocated,
        "end_user_ids" if end_users else "user_ids": {"from": ids[0], "to": ids[1]},
    }
    return Change(AuditAction.MESSAGE_IDS_ALLOCATE, AuditTarget.MESSAGE_LENGTH, length, None, after)


# --- verification --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainBreak:
    """The first entry where the trail is broken (its seq), how, and why."""

    seq: int
    kind: BreakKind
    reason: str

    def __str__(self) -> str:
        return f"entry {self.seq} {self.kind}: {self.reason}"


class ChainVerifier:
    """Checks a trail entry by entry in sequence order (:meth:`add`), then its head (:meth:`close`).

    ``public_keys``: the raw Ed25519 keys the entries may be signed by (the gateway's report key;
    its older keys too after the signing secret changed). ``anchor``: a head exported earlier
    (seq, hash): the trail must still hold that entry with that hash.
    """

    def __init__(self, public_keys: Sequence[bytes], *, anchor: tuple[int, str] | None = None) -> None:
        self._keys = {key_id_of(raw): Ed25519PublicKey.from_public_bytes(raw) for raw in public_keys}
        self._anchor = anchor
        self.count = 0
        self.last_seq = 0
        self.last_hash = GENESIS_HASH
        self.key_ids: set[str] = set()

    def add(self, entry: Mapping[str, Any]) -> ChainBreak | None:
        """Check the next entry (as stored or as the API serves it); None when it is intact."""
        payload = {name: value for name, value in entry.items() if name not in UNSIGNED_FIELDS}
        seq = int(payload.get("seq", 0))
        try:
            digest = entry_hash(payload)
        except (TypeError, ValueError):
            return ChainBreak(seq, "altered", "its fields are not canonical JSON")
        if digest != entry.get("entry_hash"):
            return ChainBreak(seq, "altered", "its hash does not match its fields (a field was changed)")
        key_id = payload.get("key_id")
        key = self._keys.get(str(key_id))
        if key is None:
            return ChainBreak(
                seq, "altered", f"it is signed by key {key_id!r}, not by a given public key ({', '.join(self._keys)})"
            )
        try:
            key.verify(base64.b64decode(str(entry.get("signature")), validate=True), canonical_json(payload))
        except (InvalidSignature, binascii.Error, ValueError):
            return ChainBreak(seq, "altered", "its signature does not match its fields (changed or forged)")
        expected = self.last_seq + 1
        if seq != expected:
            return ChainBreak(
                expected,
                "removed",
                f"entry {seq} follows entry {self.last_seq}"
                + (f": entries {expected}–{seq - 1} are missing" if seq > expected + 1 else ""),
            )
        if payload.get("prev_hash") != self.last_hash:
            before = f"entry {seq - 1}" if seq > 1 else "the genesis"
            return ChainBreak(
                seq,
                "removed",
                f"its prev_hash is not the hash of {before}: an entry before it was removed or replaced",
            )
        if self._anchor is not None and self._anchor[0] == seq and self._anchor[1] != digest:
            return ChainBreak(seq, "altered", "its hash is not the anchor's: the trail was rewritten since the export")
        self.count += 1
        self.last_seq = seq
        self.last_hash = digest
        self.key_ids.add(str(key_id))
        return None

    def close(self, head: tuple[int, str] | None) -> ChainBreak | None:
        """Check the head row (its seq and hash) against the last entry; None when they agree."""
        if head is None:
            return ChainBreak(self.last_seq, "altered", "the trail's head row is missing")
        head_seq, head_hash = head
        if self._anchor is not None and self._anchor[0] > max(head_seq, self.last_seq):
            return ChainBreak(
                self.last_seq + 1,
                "truncated",
                f"the anchor names entry {self._anchor[0]}, the trail ends at entry {self.last_seq}: "
                "entries were removed from the end (the head row was moved back too)",
            )
        if head_seq > self.last_seq:
            first = self.last_seq + 1
            missing = f"entry {first} was" if head_seq == first else f"entries {first}–{head_seq} were"
            return ChainBreak(
                first,
                "truncated",
                f"the head says the trail holds {head_seq} entries, it ends at entry {self.last_seq}: "
                f"{missing} removed from the end",
            )
        if head_seq < self.last_seq:
            return ChainBreak(
                head_seq + 1,
                "altered",
                f"it lies past the head (entry {head_seq}): the head row was moved back, or entries were "
                "written around the gateway",
            )
        if head_hash != self.last_hash:
            return ChainBreak(self.last_seq, "altered", "the head row's hash is not this entry's hash")
        return None
