"""End users as the admin API serves them, and the change of an end user's own limits."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.schemas.admin import Limit
from service.schemas.common import MessageIdOut, Page
from service.vocabulary import EndUserStatus

OWN_LIMIT_DOCS = {
    "requests_per_minute": "Requests this end user may start per minute, its own (null: the account's "
    "end_user_requests_per_minute, else XMARK_END_USER_REQUESTS_PER_MINUTE; 0: unlimited).",
    "tokens_per_minute": "Tokens this end user may use per minute, its own (null: the account's "
    "end_user_tokens_per_minute, else XMARK_END_USER_TOKENS_PER_MINUTE; 0: unlimited).",
}


class EndUserLimits(BaseModel):
    """The limits this end user's requests are held to now (0: unlimited), on top of the account's
    own: its own where set, else the account's end-user limits, else the gateway's defaults."""

    requests_per_minute: int
    tokens_per_minute: int


class EndUserUsage(BaseModel):
    """What the end user's generation records hold from ``since`` on (the last 24 hours)."""

    since: datetime
    requests: int = Field(description="generation requests (chat, completions, responses, messages)")
    tokens: int = Field(description="prompt tokens (once per request) plus completion tokens")


class EndUserOut(BaseModel):
    id: int
    user_id: int = Field(description="the account (the API key's owner) whose end user this is")
    identifier: str = Field(description="as the platform sent it (safety_identifier, user or metadata.user_id)")
    status: EndUserStatus
    message_ids: list[MessageIdOut]
    created_at: datetime = Field(description="first seen")
    last_seen_at: datetime = Field(description="last seen, to the minute")
    requests_per_minute: int | None = Field(default=None, description=OWN_LIMIT_DOCS["requests_per_minute"])
    tokens_per_minute: int | None = Field(default=None, description=OWN_LIMIT_DOCS["tokens_per_minute"])
    limits: EndUserLimits
    usage: EndUserUsage


class EndUserPage(Page[EndUserOut]):
    pass


class UpdateEndUserRequest(BaseModel):
    """Only the fields sent change; a limit sent as null goes back to the account's end-user limit."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: Limit = Field(default=None, description=OWN_LIMIT_DOCS["requests_per_minute"])
    tokens_per_minute: Limit = Field(default=None, description=OWN_LIMIT_DOCS["tokens_per_minute"])

    def changes(self) -> dict[str, Any]:
        """The fields the request sent, with their new values."""
        return {name: getattr(self, name) for name in self.model_fields_set}
