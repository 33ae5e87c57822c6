"""The gateway's vocabulary, defined once: roles, user and key-version statuses, finish reasons,
trace verdicts. Models (check constraints), schemas, routers, services and the CLI use these."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What an API key's user may do: generate (user), trace (auditor), everything (admin)."""

    USER = "user"
    AUDITOR = "auditor"
    ADMIN = "admin"


class UserStatus(StrEnum):
    ACTIVE = "active"
    DISABLED = "disabled"
    DELETED = "deleted"  # a tombstone: the row and its message ID are kept for tracing


class KeyVersionStatus(StrEnum):
    ACTIVE = "active"  # encodes new generations; /trace tries it
    PENDING = "pending"  # configured, not yet activated; /trace tries it
    RETIRED = "retired"  # neither encodes nor is tried


class FinishReason(StrEnum):
    """Why a choice ended. ``cancelled``: the client went away; ``error``: the backend failed midway."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"
    ERROR = "error"


class TraceVerdict(StrEnum):
    WATERMARKED = "watermarked"
    NOT_WATERMARKED = "not_watermarked"


class TraceDecoder(StrEnum):
    """How /trace reads a text. ``auto``: counting first, the likelihood decoder when counting names
    nobody and the model can score the text; the report says which one decided."""

    AUTO = "auto"
    COUNTING = "counting"
    LIKELIHOOD = "likelihood"
