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


class EndUserStatus(StrEnum):
    """An account's end user (``end_users``): disabled and deleted end users get 403; a deleted
    one is a tombstone whose message IDs stay reserved and whose texts keep tracing."""

    ACTIVE = "active"
    DISABLED = "disabled"
    DELETED = "deleted"


class EndUserSlot(StrEnum):
    """A row of ``end_users`` that is not (yet, or any more) an end user of its own (migration 0016):
    never listed, counted or named as one.

    * ``reserved``: drawn ahead with its message IDs and no identifier, for a first sight to take
      without a statement (``service.end_users.reserve``); the account's tally counts it.
    * ``void``: a reserved row given back unused (its process stopped): its IDs stay reserved.
    * ``merged``: a reserved row whose first sight lost a race for its identifier to another
      replica: its texts name the winner (``merged_into``)."""

    RESERVED = "reserved"
    VOID = "void"
    MERGED = "merged"


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


class AuditActorKind(StrEnum):
    """Who changed the registry: an admin through the API, an operator's ``xmark`` command, or the
    gateway itself at start-up."""

    API = "api"
    CLI = "cli"
    SYSTEM = "system"


class AuditAction(StrEnum):
    """What an entry of the registry's audit trail records (``<target>.<verb>``)."""

    USER_CREATE = "user.create"
    USER_UPDATE = "user.update"
    USER_DISABLE = "user.disable"
    USER_ENABLE = "user.enable"
    USER_DELETE = "user.delete"
    API_KEY_ISSUE = "api_key.issue"
    API_KEY_REVOKE = "api_key.revoke"
    KEY_VERSION_REGISTER = "key_version.register"  # start-up: a configured secret's row, pending
    KEY_VERSION_ACTIVATE = "key_version.activate"
    KEY_VERSION_RETIRE = "key_version.retire"
    MESSAGE_IDS_ALLOCATE = "message_ids.allocate"  # start-up: IDs of a new length for existing users
    END_USER_CREATE = "end_user.create"  # first sight of an account's end user (actor: the account)
    END_USER_UPDATE = "end_user.update"  # its own rate limits
    END_USER_DISABLE = "end_user.disable"
    END_USER_ENABLE = "end_user.enable"
    END_USER_DELETE = "end_user.delete"
    # a reserved slot whose first sight another replica's beat for the identifier: its IDs name that end user
    END_USER_MERGE = "end_user.merge"


class AuditTarget(StrEnum):
    """The kind of registry row an audit entry is about (its id is the row's id; for
    ``message_length``, ``<bits>/<block_bits>``)."""

    USER = "user"
    API_KEY = "api_key"
    KEY_VERSION = "key_version"
    MESSAGE_LENGTH = "message_length"
    END_USER = "end_user"
