"""Schemas of the admin API (users, API keys, key versions)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from service.schemas.common import MessageIdOut, Page
from service.schemas.text import reject_lone_surrogates
from service.security import KEY_PATTERN
from service.vocabulary import KeyVersionStatus, Role, UserStatus

UserName = Annotated[
    str,
    AfterValidator(reject_lone_surrogates),
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$"),
]
KeyVersionName = Annotated[str, StringConstraints(strip_whitespace=True, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A per-user admission limit: null (or absent) takes the gateway's default (XMARK_USER_*), 0 is
# unlimited. The bound keeps the value inside the database's integer column.
Limit = Annotated[int | None, Field(ge=0, le=2**31 - 1)]
LIMIT_DOCS = {
    "max_parallel_requests": "Requests of this user in progress at once (null: gateway default, 0: unlimited).",
    "requests_per_minute": "Requests this user may start per minute (null: gateway default, 0: unlimited).",
    "tokens_per_minute": "Prompt and completion tokens per minute (null: gateway default, 0: unlimited).",
}
LIMIT_FIELDS = tuple(LIMIT_DOCS)
# The account's limits on its end users (the platform's own users, ``/admin/users/{id}/end-users``):
# null takes the gateway's default (XMARK_END_USERS_*, XMARK_END_USER_*), 0 is unlimited.
END_USER_LIMIT_DOCS = {
    "end_users_max": "End users this account may have in all, deleted ones included "
    "(null: XMARK_END_USERS_MAX_PER_ACCOUNT, 0: unlimited).",
    "end_users_new_per_minute": "New end users this account may add per minute "
    "(null: XMARK_END_USERS_NEW_PER_MINUTE, 0: unlimited).",
    "end_user_requests_per_minute": "Requests each end user of this account may start per minute, unless the "
    "end user has its own (null: XMARK_END_USER_REQUESTS_PER_MINUTE, 0: unlimited).",
    "end_user_tokens_per_minute": "Tokens each end user of this account may use per minute, unless the end "
    "user has its own (null: XMARK_END_USER_TOKENS_PER_MINUTE, 0: unlimited).",
}
END_USER_LIMIT_FIELDS = tuple(END_USER_LIMIT_DOCS)


def _not_a_credential(value: str) -> str:
    if KEY_PATTERN.search(value):
        raise ValueError("must not contain an API key")
    return value


class CreateUserRequest(_Request):
    name: UserName
    role: Role = Role.USER
    max_parallel_requests: Limit = Field(default=None, description=LIMIT_DOCS["max_parallel_requests"])
    requests_per_minute: Limit = Field(default=None, description=LIMIT_DOCS["requests_per_minute"])
    tokens_per_minute: Limit = Field(default=None, description=LIMIT_DOCS["tokens_per_minute"])

    @field_validator("name")
    @classmethod
    def _name_not_a_credential(cls, value: str) -> str:
        return _not_a_credential(value)

    def limits(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_FIELDS}


class UpdateUserRequest(_Request):
    """Only the fields sent change; a limit sent as null goes back to the gateway's default."""

    name: UserName | None = None
    role: Role | None = None
    max_parallel_requests: Limit = Field(default=None, description=LIMIT_DOCS["max_parallel_requests"])
    requests_per_minute: Limit = Field(default=None, description=LIMIT_DOCS["requests_per_minute"])
    tokens_per_minute: Limit = Field(default=None, description=LIMIT_DOCS["tokens_per_minute"])
    end_users_max: Limit = Field(default=None, description=END_USER_LIMIT_DOCS["end_users_max"])
    end_users_new_per_minute: Limit = Field(default=None, description=END_USER_LIMIT_DOCS["end_users_new_per_minute"])
    end_user_requests_per_minute: Limit = Field(
        default=None, description=END_USER_LIMIT_DOCS["end_user_requests_per_minute"]
    )
    end_user_tokens_per_minute: Limit = Field(
        default=None, description=END_USER_LIMIT_DOCS["end_user_tokens_per_minute"]
    )

    @field_validator("name", "role", mode="before")
    @classmethod
    def _not_null(cls, value: object) -> object:
        if value is None:
            raise ValueError("must not be null")
        return value

    @field_validator("name")
    @classmethod
    def _name_not_a_credential(cls, value: str | None) -> str | None:
        return None if value is None else _not_a_credential(value)

    def changes(self) -> dict[str, Any]:
        """The fields the request sent, with their new values."""
        return {name: getattr(self, name) for name in self.model_fields_set}


MESSAGE_ID_DOC = "The user's message ID of the length the active key version encodes with."
MESSAGE_IDS_DOC = "The user's message ID of every message length it holds one of (one per length in use)."


class CreatedUser(BaseModel):
    """Returned once at creation: ``api_key`` is never shown again."""

    id: int
    name: str
    role: Role
    message_id: str = Field(description=MESSAGE_ID_DOC)
    message_ids: list[MessageIdOut] = Field(default_factory=list, description=MESSAGE_IDS_DOC)
    max_parallel_requests: int | None = Field(default=None, description=LIMIT_DOCS["max_parallel_requests"])
    requests_per_minute: int | None = Field(default=None, description=LIMIT_DOCS["requests_per_minute"])
    tokens_per_minute: int | None = Field(default=None, description=LIMIT_DOCS["tokens_per_minute"])
    api_key: str


class UserOut(BaseModel):
    id: int
    name: str
    role: Role
    status: UserStatus
    message_id: str = Field(description=MESSAGE_ID_DOC)
    message_ids: list[MessageIdOut] = Field(default_factory=list, description=MESSAGE_IDS_DOC)
    max_parallel_requests: int | None = Field(default=None, description=LIMIT_DOCS["max_parallel_requests"])
    requests_per_minute: int | None = Field(default=None, description=LIMIT_DOCS["requests_per_minute"])
    tokens_per_minute: int | None = Field(default=None, description=LIMIT_DOCS["tokens_per_minute"])
    end_users_max: int | None = Field(default=None, description=END_USER_LIMIT_DOCS["end_users_max"])
    end_users_new_per_minute: int | None = Field(
        default=None, description=END_USER_LIMIT_DOCS["end_users_new_per_minute"]
    )
    end_user_requests_per_minute: int | None = Field(
        default=None, description=END_USER_LIMIT_DOCS["end_user_requests_per_minute"]
    )
    end_user_tokens_per_minute: int | None = Field(
        default=None, description=END_USER_LIMIT_DOCS["end_user_tokens_per_minute"]
    )
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None = None


class UserPage(Page[UserOut]):
    pass


class IssuedKey(BaseModel):
    """Returned once when a key is issued: ``api_key`` is never shown again."""

    id: int
    api_key: str
    prefix: str
    created_at: datetime


class ApiKeyOut(BaseModel):
    """A key as listed: display prefix and timestamps only."""

    id: int
    user_id: int
    prefix: str
    created_at: datetime
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None


class ApiKeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ApiKeyOut]


class AddKeyVersionRequest(_Request):
    name: KeyVersionName


class CompanionEncoderOut(BaseModel):
    """The biasing encoder of a per-request key version (its message bits are the version's)."""

    scheme: str
    block_bits: int
    num_keys: int
    delta: float
    min_entropy: float = 0.0
    fingerprint: str = Field(description="Non-secret fingerprint of the companion's own key.")


class KeyVersionOut(BaseModel):
    id: int
    name: str
    status: KeyVersionStatus
    bits: int
    block_bits: int
    num_keys: int
    delta: float
    scheme: str
    min_entropy: float = Field(
        default=0.0, description="Entropy rule: positions whose min-entropy (nats) is below this are not biased."
    )
    salts: int = Field(
        default=1, description="Scheme gumbel: the salts its answers draw from (1: none; the decoders try each)."
    )
    fingerprint: str = Field(description="Non-secret fingerprint of the watermark key.")
    companion: CompanionEncoderOut | None = Field(
        default=None,
        description="A per-request version's biasing encoder (scheme auto): its parameters and fingerprint; "
        "null for a version of one scheme.",
    )
    configured: bool = Field(description="Whether this process holds the secret of this version.")
    created_at: datetime
    activated_at: datetime | None = None
    retired_at: datetime | None = None


class KeyVersionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyVersionOut]


class ApiKeyPage(Page[ApiKeyOut]):
    pass


class UsageDay(BaseModel):
    """One user's generations and embedding requests of one UTC day."""

    user_id: int
    user_name: str
    day: str = Field(description="UTC day, YYYY-MM-DD")
    requests: int = Field(description="distinct generation requests (chat, completions, responses)")
    completions: int = Field(description="completions (choices) recorded")
    prompt_tokens: int = Field(description="prompt tokens of generation requests, counted once per request")
    completion_tokens: int
    embedding_requests: int = Field(default=0, description="POST /v1/embeddings requests")
    embedding_tokens: int = Field(default=0, description="input tokens of those embedding requests")


class UsagePage(Page[UsageDay]):
    pass
