"""GET /me."""

from __future__ import annotations

from pydantic import BaseModel

from service.vocabulary import Role


class Me(BaseModel):
    """The user an API key belongs to."""

    user_id: int
    name: str
    role: Role
