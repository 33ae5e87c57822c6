"""The end-user identifier a request carries: checked here, for every API, before anything is generated.

A string of 1 to ``MAX_IDENTIFIER_CHARS`` characters, stored as sent. It may not hold an unpaired
surrogate (it could not be stored) or an API key (it is shown to admins and auditors and kept in the
audit trail, where a key must never appear). Every refusal is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import InvalidRequestError
from service.schemas.text import has_lone_surrogate
from service.security import KEY_PATTERN

MAX_IDENTIFIER_CHARS = 256

# OpenAI's fields naming the end user: ``safety_identifier`` and its older name ``user``
OPENAI_FIELDS = ("safety_identifier", "user")


def checked_identifier(value: Any, param: str) -> str | None:
    """``value`` as an end-user identifier (None: the request names none); 400 naming ``param``."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_IDENTIFIER_CHARS:
        raise InvalidRequestError(
            f"'{param}' must be a string of 1 to {MAX_IDENTIFIER_CHARS} characters", param=param, code="invalid_value"
        )
    if has_lone_surrogate(value):
        raise InvalidRequestError(
            f"'{param}' must not contain unpaired UTF-16 surrogates", param=param, code="invalid_value"
        )
    if KEY_PATTERN.search(value):
        raise InvalidRequestError(
            f"'{param}' must not hold an API key; send a stable identifier of the end user (e.g. an HMAC of its id)",
            param=param,
            code="invalid_value",
        )
    return value


def openai_identifier(fields: Mapping[str, Any]) -> str | None:
    """The end user an OpenAI request names: ``safety_identifier`` or ``user`` (the same value when
    both are sent; two different values are refused, naming ``safety_identifier``)."""
    safety = checked_identifier(fields.get("safety_identifier"), "safety_identifier")
    user = checked_identifier(fields.get("user"), "user")
    if safety is not None and user is not None and safety != user:
        raise InvalidRequestError(
            "'safety_identifier' and 'user' name different end users; send one of them (user is its older name)",
            param="safety_identifier",
            code="invalid_value",
        )
    return safety if safety is not None else user
