"""Schemas shared by every router: the error envelope and the authenticated principal."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from service.vocabulary import Role

__all__ = ["ERROR_RESPONSES", "ErrorDetail", "ErrorEnvelope", "MessageIdOut", "Principal", "Role"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    """OpenAI-style error body."""

    error: ErrorDetail


class MessageIdOut(BaseModel):
    """A user's message ID of one message length (``bits`` bits in blocks of ``block_bits``)."""

    model_config = ConfigDict(frozen=True)

    bits: int
    block_bits: int
    message_id: str


class Principal(BaseModel):
    """The authenticated caller of a request."""

    model_config = ConfigDict(frozen=True)

    user_id: int
    name: str
    role: Role
    api_key_id: int
    # one per message length in use, shortest first: a generation embeds the one of its key version's length
    message_ids: tuple[MessageIdOut, ...] = ()
    # the user's admission limits (users columns): None takes the gateway's default, 0 is unlimited
    max_parallel_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def message_id_for(self, bits: int, block_bits: int) -> str | None:
        """The caller's message ID of that length, or None when it has none."""
        return next(
            (m.message_id for m in self.message_ids if m.bits == bits and m.block_bits == block_bits),
            None,
        )


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorEnvelope} for status in (400, 401, 403, 404, 409, 413, 422, 503)
}
