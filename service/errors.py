"""Domain exceptions and the one mapping from them to the error envelopes.

Envelope: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's), on every route but those
of Anthropic's Messages API (``ANTHROPIC_PATHS``), whose errors take Anthropic's envelope
``{"type": "error", "error": {"type", "message"}}`` and its status codes (``anthropic_status``):
the same error, in the shape the route's clients parse. Messages never carry request
values: validation errors name the field and the rule, not the input, and whatever a message or
parameter name still echoes (a number in a range check, a name the client chose) is cut to a short
excerpt.

A database that is down, hung or saturated is answered 503 ``database_unavailable`` with
Retry-After, whatever the route was doing (``service.db.is_database_fault`` says which errors
mean that); every other unexpected error is a 500 that closes the connection, and says so.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.db.engine import is_database_fault
from service.exceptions import ServiceError
from service.security import KEY_PATTERN

logger = logging.getLogger("xmark.errors")

_BEARER = re.compile(r"(?i)bearer\s+\S+")
# echoed client input is cut to an excerpt: a number of more than 32 digits, a word of more than 80
# characters, a message of more than 400 and a parameter name of more than 120
_LONG_NUMBER = re.compile(r"\d{33,}")
_LONG_WORD = re.compile(r"\S{81,}")
MAX_MESSAGE_CHARS = 400
MAX_PARAM_CHARS = 120


class GatewayError(ServiceError):
    """Base of every error the gateway reports to a client."""

    status_code: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers


class InvalidRequestError(GatewayError):
    status_code = 400
    type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationError(GatewayError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(GatewayError):
    status_code = 403
    type = "permission_error"
    code = "permission_denied"


class NotFoundError(GatewayError):
    status_code = 404
    type = "not_found_error"
    code = "not_found"


class ConflictError(GatewayError):
    status_code = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLargeError(GatewayError):
    status_code = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class ServiceUnavailableError(GatewayError):
    status_code = 503
    type = "service_unavailable"
    code = "not_ready"


class UpstreamUnavailableError(GatewayError):
    status_code = 503
    type = "service_unavailable"
    code = "upstream_unavailable"


class RateLimitError(GatewayError):
    """429: a limit of the caller (named in ``code``/the message) or the gateway's queue is full."""

    status_code = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None, param: str | None = None):
        super().__init__(
            message, code=code, param=param, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))}
        )


class DatabaseUnavailableError(GatewayError):
    """503: the database did not answer in time (down, hung or saturated); retry after a moment."""

    status_code = 503
    type = "service_unavailable"
    code = "database_unavailable"

    def __init__(self, message: str = "The database is unavailable; retry shortly", *, retry_after_s: float = 1.0):
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class RequestTimeoutError(GatewayError):
    """504: the request did not finish within ``request_timeout_s``."""

    status_code = 504
    type = "timeout_error"
    code = "request_timeout"


class UpstreamTimeoutError(GatewayError):
    status_code = 504
    type = "service_unavailable"
    code = "upstream_timeout"


def scrub(text: str) -> str:
    """Remove anything shaped like an API key or bearer credential from ``text``."""
    return KEY_PATTERN.sub("[redacted]", _BEARER.sub("Bearer [redacted]", text))


def _excerpt(text: str, limit: int) -> str:
    """``text`` with long numbers and words cut, at most ``limit`` characters."""
    text = _LONG_NUMBER.sub(lambda m: f"{m.group()[:8]}...({len(m.group())} digits)", text)
    text = _LONG_WORD.sub(lambda m: f"{m.group()[:40]}...", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def envelope(message: str, *, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": _excerpt(scrub(message), MAX_MESSAGE_CHARS),
            "type": type_,
            "param": _excerpt(scrub(param), MAX_PARAM_CHARS) if param is not None else None,
            "code": code,
        }
    }


# The routes of Anthropic's Messages API (``service.routers.messages``): their errors, and theirs
# only, are answered in Anthropic's envelope.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# The gateway's status -> Anthropic's status and error type. Anthropic has no 422: a body that does
# not match the schema is a 400 ``invalid_request_error`` there. A 503 (the gateway's "retry
# shortly": the model loading, the workers or the database unavailable) keeps its status, with
# the type of Anthropic's 529 (``overloaded_error``); any other 5xx is a 500 ``api_error``.
ANTHROPIC_STATUSES: Mapping[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    405: (405, "invalid_request_error"),
    408: (408, "invalid_request_error"),
    409: (409, "invalid_request_error"),
    413: (413, "request_too_large"),
    422: (400, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    500: (500, "api_error"),
    503: (503, "overloaded_error"),
    504: (504, "timeout_error"),
}


def anthropic_status(status: int) -> tuple[int, str]:
    """The status and Anthropic error type that answer an error of the gateway's ``status``."""
    known = ANTHROPIC_STATUSES.get(status)
    if known is not None:
        return known
    return (500, "api_error") if status >= 500 else (status, "invalid_request_error")


def speaks_anthropic(scope: Mapping[str, Any]) -> bool:
    """Whether the request of an ASGI ``scope`` is on a route of Anthropic's Messages API."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root) :]
    return path in ANTHROPIC_PATHS


def anthropic_envelope(message: str, *, status: int, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body for an error of the gateway's ``status``. Its envelope has no
    ``param``: a field the message does not name already leads it (``max_tokens: ...``), as
    Anthropic words its own."""
    if param is not None and f"'{param}'" not in message:
        message = f"{_excerpt(scrub(param), MAX_PARAM_CHARS)}: {message}"
    _, type_ = anthropic_status(status)
    return {"type": "error", "error": {"type": type_, "message": _excerpt(scrub(message), MAX_MESSAGE_CHARS)}}


def error_body(
    scope: Mapping[str, Any], status: int, message: str, *, type_: str, code: str | None, param: str | None = None
) -> tuple[int, dict[str, Any]]:
    """The status and body that answer an error to the request of ``scope``: Anthropic's on its
    routes, OpenAI's everywhere else."""
    if speaks_anthropic(scope):
        return anthropic_status(status)[0], anthropic_envelope(message, status=status, param=param)
    return status, envelope(message, type_=type_, code=code, param=param)


def _location(loc: tuple[Any, ...] | list[Any]) -> tuple[str, str | None]:
    parts = list(loc)
    source = str(parts[0]) if parts else "body"
    if parts and parts[0] in {"body", "query", "path", "header", "cookie"}:
        parts = parts[1:]
    dotted = ".".join(str(p) for p in parts)
    return source, (dotted or None)


def validation_envelope(exc: RequestValidationError) -> dict[str, Any]:
    """422 envelope naming the first offending field; never includes the input value."""
    errors = exc.errors()
    if not errors:
        return envelope("Invalid request", type_="invalid_request_error", code="invalid_value")
    first = errors[0]
    source, param = _location(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return envelope(
            "Request body is not valid JSON",
            type_="invalid_request_error",
            code="invalid_json",
            param=None,
        )
    reason = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing" and param is None and source == "body":
        message = "Request body is required"
    elif param is None:
        message = f"Invalid request {source}: {reason}"
    else:
        message = f"Invalid value for '{param}': {reason}"
    extra = len(errors) - 1
    if extra:
        message += f" (and {extra} more error{'s' if extra > 1 else ''})"
    code = "missing_field" if first.get("type") == "missing" else "invalid_value"
    return envelope(message, type_="invalid_request_error", code=code, param=param)


HTTP_ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_body_timeout"),
    413: ("invalid_request_error", "payload_too_large"),
}


def redact_known_secrets(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """Replace every configured secret (``Resources.secret_values``) in the envelope text."""
    resources = getattr(request.app.state, "resources", None)
    secrets: tuple[str, ...] = resources.secret_values if resources is not None else ()
    error = body["error"]
    for field in ("message", "param"):
        value = error.get(field)
        if isinstance(value, str):
            for secret in secrets:
                value = value.replace(secret, "[redacted]")
            error[field] = value
    return body


async def _gateway_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    status, body = error_body(
        request.scope, exc.status_code, exc.message, type_=exc.type, code=exc.code, param=exc.param
    )
    return JSONResponse(redact_known_secrets(request, body), status_code=status, headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    body = validation_envelope(exc)
    status = 422
    if speaks_anthropic(request.scope):
        detail = body["error"]
        status, body = error_body(
            request.scope, status, detail["message"], type_=detail["type"], code=detail["code"], param=detail["param"]
        )
    return JSONResponse(redact_known_secrets(request, body), status_code=status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_, code = HTTP_ERROR_TYPES.get(exc.status_code, ("invalid_request_error", "http_error"))
    if exc.status_code == 404:
        message = "Not found"
    elif exc.status_code == 405:
        message = "Method not allowed"
    else:
        message = str(exc.detail) if isinstance(exc.detail, str) else "Request failed"
    status, body = error_body(request.scope, exc.status_code, message, type_=type_, code=code)
    return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))


def _internal_error(request: Request) -> JSONResponse:
    status, body = error_body(request.scope, 500, "Internal server error", type_="server_error", code="internal_error")
    return JSONResponse(body, status_code=status)


async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # the error's text may quote the statement and its rows: only its type is logged
    logger.warning("database unavailable", extra={"error_type": type(exc).__name__})
    resources = getattr(request.app.state, "resources", None)
    if resources is not None:
        resources.metrics.database_unavailable.inc()
    return await _gateway_error(request, DatabaseUnavailableError())


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    """503 for a database fault; any other database error is a bug (500, logged by type only)."""
    if is_database_fault(exc):
        return await _database_unavailable(request, exc)
    logger.error("unhandled database error", extra={"error_type": type(exc).__name__})
    return _internal_error(request)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """The last resort (Starlette's server-error middleware). The server closes the connection after
    this response, so the response says ``Connection: close`` and the client does not reuse it."""
    if is_database_fault(exc):
        response = await _database_unavailable(request, exc)
    else:
        logger.error("unhandled error", extra={"error_type": type(exc).__name__})
        response = _internal_error(request)
    response.headers["Connection"] = "close"
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the app can raise to its error envelope (``error_body``).

    Database errors are handled inside the app (the connection stays usable after a 503); the
    handler of ``Exception`` runs in Starlette's outermost middleware, which re-raises so that the
    server logs the traceback, and the server then closes the connection.
    """
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(SQLAlchemyError, _database_error)
    app.add_exception_handler(Exception, _unexpected_error)
