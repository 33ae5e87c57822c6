"""End users as the admin API serves them."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from service.schemas.common import MessageIdOut, Page
from service.vocabulary import EndUserStatus


class EndUserOut(BaseModel):
    id: int
    user_id: int = Field(description="the account (the API key's owner) whose end user this is")
    identifier: str = Field(description="as the platform sent it (safety_identifier, user or metadata.user_id)")
    status: EndUserStatus
    message_ids: list[MessageIdOut]
    created_at: datetime = Field(description="first seen")
    last_seen_at: datetime = Field(description="last seen, to the minute")


class EndUserPage(Page[EndUserOut]):
    pass
