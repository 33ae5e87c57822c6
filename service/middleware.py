"""ASGI middleware: request context (request id, metrics, access log) and the request body's limits."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import HTTPException
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import HTTP_ERROR_TYPES, error_body

if TYPE_CHECKING:
    from service.resources import Resources

access_logger = logging.getLogger("xmark.access")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _route_template(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class RequestContextMiddleware:
    """Assigns a request id, counts requests and latency per route, writes one access-log line.

    The access log holds method, route template, status, duration and user id: never headers,
    query strings or bodies.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # always generated here: echoing a client-chosen value could echo anything
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500
        completed: float | None = None  # when the last byte of the response was handed over

        async def send_with_id(message: Message) -> None:
            nonlocal status, completed
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = MutableHeaders(scope=message)
                headers.append("X-Request-ID", request_id)
                # the gateway's time on this request until its response starts (W3C Server-Timing)
                headers.append("Server-Timing", f"app;dur={(time.perf_counter() - started) * 1000:.3f}")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = time.perf_counter()

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # the latency the client sees: work after the response (its generation record) is not in it
            elapsed = (completed if completed is not None else time.perf_counter()) - started
            route = _route_template(scope)
            resources: Resources | None = getattr(scope["app"].state, "resources", None)  # None before start-up
            if resources is not None:
                metrics = resources.metrics
                metrics.requests.labels(route=route, method=scope["method"], status=str(status)).inc()
                metrics.latency.labels(route=route).observe(elapsed)
            principal = scope["state"].get("principal")
            access_logger.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": route,
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 2),
                    "user_id": getattr(principal, "user_id", None),
                },
            )


# an unread request body up to this size does not cost the connection (uvicorn buffers this much)
KEEP_ALIVE_BODY_BYTES = 65_536


class RequestBodyMiddleware:
    """Limits of a request body: its size and the time it takes to arrive.

    * Over ``max_body_bytes``: 413, by Content-Length before anything else, and while reading (a
      chunked upload).
    * Not complete ``body_read_timeout_s`` after the request head: 408.

    The body is read only when the route reads it. A protected route authenticates from the
    headers first (``service.routing``), so a client without a valid key is refused before a byte
    of its body is read, and no body is buffered here. A response that starts before a large body
    (over :data:`KEEP_ALIVE_BODY_BYTES`, or of unknown length) was read says ``Connection: close``:
    the server closes the connection rather than read the rest. A smaller one keeps the connection:
    the server reads and discards the rest before the next request (``service.server`` closes the
    connection when the next request's head is not complete within the keep-alive timeout).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_read_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s

    def _too_large(self) -> HTTPException:
        return HTTPException(
            413, f"Request body exceeds the limit of {self.max_body_bytes} bytes", headers={"Connection": "close"}
        )

    async def _reject(self, scope: Scope, send: Send, error: HTTPException) -> None:
        type_, code = HTTP_ERROR_TYPES[error.status_code]
        status, payload = error_body(scope, error.status_code, str(error.detail), type_=type_, code=code)
        body = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, send, self._too_large())
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_read_timeout_s
        # neither Content-Length (other than 0) nor Transfer-Encoding: there is no body to wait for
        chunked = _header(scope, b"transfer-encoding") is not None
        complete = (declared is None or declared.strip() == "0") and not chunked
        small = not chunked and declared is not None and declared.strip().isdigit()
        small = small and int(declared or 0) <= KEEP_ALIVE_BODY_BYTES
        received = 0

        async def limited_receive() -> Message:
            nonlocal complete, received
            if complete:  # e.g. waiting for the client to disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"The request body did not arrive within {self.body_read_timeout_s:g} s",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] != "http.request":
                complete = True
                return message
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise self._too_large()
            complete = not message.get("more_body", False)
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not complete and not small:
                MutableHeaders(scope=message)["connection"] = "close"
            await send(message)

        await self.app(scope, limited_receive, send_closing)
