"""Schemas of the registry's audit trail (GET /admin/audit)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.vocabulary import AuditActorKind


class AuditActorOut(BaseModel):
    kind: AuditActorKind = Field(description="api (an admin through the API), cli (an `xmark` command) or system")
    user_id: int | None = Field(default=None, description="the acting user (kind api)")
    name: str | None = Field(default=None, description="the acting user's name when the change was made")


class AuditTargetOut(BaseModel):
    type: str = Field(description="user, api_key, key_version or message_length")
    id: str = Field(description="the row's id (message_length: <bits>/<block_bits>)")


class AuditEntryOut(BaseModel):
    """One change to the registry. The signed payload is this object without ``entry_hash`` and
    ``signature``; ``entry_hash`` is the SHA-256 of its canonical JSON (RFC 8785)."""

    seq: int = Field(description="1, 2, 3, … without gaps")
    created_at: str = Field(description="UTC, as signed: 2026-12-09T01:02:03.456789Z")
    actor: AuditActorOut
    action: str = Field(description="user.create, user.update, api_key.revoke, key_version.activate, …")
    target: AuditTargetOut
    changes: dict[str, Any] = Field(
        description="the changed fields: {'before': {...} | null, 'after': {...} | null}; "
        "never a key, a key's hash or a secret (a key is named by its id and display prefix)"
    )
    request_id: str | None = Field(description="the API request's X-Request-ID (null for the CLI and start-up)")
    prev_hash: str = Field(description="the previous entry's entry_hash (64 zeros for the first)")
    key_id: str = Field(description="the signing key's id (GET /.well-known/xmark-report-key)")
    entry_hash: str
    signature: str = Field(description="base64 Ed25519 signature of the payload's canonical JSON")


class AuditHeadOut(BaseModel):
    """The trail's head row: the last entry's seq and hash (export it to check the trail later)."""

    seq: int
    entry_hash: str


class AuditPage(BaseModel):
    """A page of entries in the order asked; ``next_after_seq`` is the ``after_seq`` of the next
    page (null on the last)."""

    object: Literal["list"] = "list"
    data: list[AuditEntryOut]
    limit: int
    has_more: bool
    next_after_seq: int | None
    head: AuditHeadOut | None
