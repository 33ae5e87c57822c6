"""ASGI middleware: request context (request id, metrics, access log) and the body-size limit."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import envelope

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


class BodySizeLimitMiddleware:
    """413 for bodies over ``max_body_bytes``: by Content-Length up front, and while reading.

    The body is read (at most ``max_body_bytes``) before the app runs, so a chunked upload
    without Content-Length is refused before anything is parsed or written.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            envelope(
                f"Request body exceeds the limit of {self.max_body_bytes} bytes",
                type_="invalid_request_error",
                code="payload_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
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
            await self._reject(send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
