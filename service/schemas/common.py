"""Schemas shared by every router: the error envelope and the authenticated principal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict

from service.vocabulary import Role

T = TypeVar("T")

__all__ = [
    "ERROR_RESPONSES",
    "UNAVAILABLE_RESPONSES",
    "EndUserIdentity",
    "ErrorDetail",
    "ErrorEnvelope",
    "MessageIdOut",
    "Page",
    "Principal",
    "Role",
]


class Page(BaseModel, Generic[T]):
    """One page of a list endpoint (``limit``/``offset``), with the total count of matches."""

    object: Literal["list"] = "list"
    data: list[T]
    total: int
    limit: int
    offset: int
    has_more: bool

    @classmethod
    def of(cls, data: Sequence[T], *, total: int, limit: int, offset: int) -> Self:
        return cls(data=list(data), total=total, limit=limit, offset=offset, has_more=offset + len(data) < total)


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


class EndUserIdentity(BaseModel):
    """The end user of the calling account a request is generated for (``end_users``): its id, the
    identifier the platform sent, and its message IDs (one per length in use, shortest first)."""

    model_config = ConfigDict(frozen=True)

    id: int
    identifier: str
    message_ids: tuple[MessageIdOut, ...] = ()
    # its own rate limits (``end_users`` columns): None takes the account's end-user limit
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def message_id_for(self, bits: int, block_bits: int) -> str | None:
        return next(
            (m.message_id for m in self.message_ids if m.bits == bits and m.block_bits == block_bits),
            None,
        )


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
    # the account's end-user limits (users columns): the caps on its end users and each end user's
    # requests and tokens per minute; None takes the gateway's default, 0 is unlimited
    end_users_max: int | None = None
    end_users_new_per_minute: int | None = None
    end_user_requests_per_minute: int | None = None
    end_user_tokens_per_minute: int | None = None
    # the account's end user the request names (``safety_identifier``, ``user``, ``metadata.user_id``):
    # its message IDs, not the account's, are embedded; the account's limits and records stay, and
    # the end user's own rate limits apply on top
    end_user: EndUserIdentity | None = None

    def message_id_for(self, bits: int, block_bits: int) -> str | None:
        """The message ID of that length a generation embeds (the end user's, when the request
        names one), or None when there is none."""
        if self.end_user is not None:
            return self.end_user.message_id_for(bits, block_bits)
        return next(
            (m.message_id for m in self.message_ids if m.bits == bits and m.block_bits == block_bits),
            None,
        )


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (a field out of range, an unsupported parameter, the context too long)",
    401: "Missing or invalid API key",
    403: "The key's role may not use this route",
    404: "No such model, user, key or report",
    408: "The request body did not arrive in time",
    409: "Conflicts with the current state (e.g. the last admin, the last key version)",
    413: "The request body is too large",
    422: "The body is not valid for this route",
    429: "A limit of the caller or the gateway's queue (see Retry-After)",
    500: "An internal error or a model failure",
    503: "The database, the model or the workers are unavailable (see Retry-After)",
    504: "The request deadline passed",
}

# Every error the gateway answers, in the OpenAI envelope, as documented in the OpenAPI schema.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorEnvelope, "description": description} for status, description in _ERROR_DESCRIPTIONS.items()
}
# The errors of a route that reads no body and needs no key (health checks).
UNAVAILABLE_RESPONSES: dict[int | str, dict[str, object]] = {503: ERROR_RESPONSES[503], 500: ERROR_RESPONSES[500]}
