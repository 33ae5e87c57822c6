"""Schemas shared by every router: the error envelope and the authenticated principal."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from service.vocabulary import Role

__all__ = ["ERROR_RESPONSES", "ErrorDetail", "ErrorEnvelope", "Principal", "Role"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    """OpenAI-style error body."""

    error: ErrorDetail


class Principal(BaseModel):
    """The authenticated caller of a request."""

    model_config = ConfigDict(frozen=True)

    user_id: int
    name: str
    role: Role
    message_id: str
    api_key_id: int


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorEnvelope} for status in (400, 401, 403, 404, 409, 413, 422, 503)
}
