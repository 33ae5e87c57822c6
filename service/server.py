"""The HTTP server of ``xmark serve`` (uvicorn), configured from Settings, and its HTTP protocol.

uvicorn's own options cover idle keep-alive connections (``timeout_keep_alive``) and the number of
connections (``limit_concurrency``: 503 beyond it). uvicorn also counts against that limit every
request task still running, and a task runs on after its response while the gateway writes the
completion's record: under load those tasks, not connections, passed the limit and clients got 503
with nothing down. :class:`GatewayHttpProtocol` counts connections only; the work after responses
is bounded by the gateway itself (``record_backlog_limit``). Its default parser
(httptools) bounds neither the size of a request head nor the time it takes to arrive:
``h11_max_incomplete_event_size`` applies to the h11 parser only, and a header of 64 MB, or one
sent a byte at a time, is read for as long as the client keeps sending. :class:`GatewayHttpProtocol`
adds both bounds to the httptools protocol. The request body has its own limits in the app
(``service.middleware.RequestBodyMiddleware``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState
from uvicorn.supervisors import Multiprocess

from service.config import Settings
from service.errors import envelope

DEFAULT_MAX_HEAD_BYTES = 16_384


def server_options(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` for a gateway process."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": GatewayHttpProtocol,
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "limit_concurrency": settings.max_connections,
        # read by GatewayHttpProtocol as its head limit (and by h11, were it chosen)
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "access_log": False,
        "log_config": None,
        "proxy_headers": False,
    }
    options.update(overrides)
    return options


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(envelope(message, type_="invalid_request_error", code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _HeadTooLarge(Exception):
    pass


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """``limit_concurrency``'s 503, in the error envelope."""
    body = json.dumps(
        envelope("The server has too many connections; retry shortly", type_="service_unavailable", code="overloaded")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GatewayHttpProtocol(HttpToolsProtocol):
    """httptools with a bounded request head and a cap on connections alone.

    * Connections: a request arriving while more than ``limit_concurrency`` connections are open
      is answered 503 ``overloaded`` (``Retry-After: 1``) and its connection closed. Requests whose
      response has gone out but whose task still runs (the record written after the response) do
      not count, unlike in uvicorn's own check.

    * Size: a request line and headers over ``h11_max_incomplete_event_size`` bytes are answered
      431 and the connection is closed; at most that much plus one read is ever buffered for a head.
    * Time: a head must be complete within ``timeout_keep_alive`` seconds of the connection opening
      or the previous response ending (the idle time of a kept-alive connection included), else
      the connection is closed. A client trickling its head a byte at a time holds a connection no
      longer than an idle one.
    """

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # uvicorn's check (connections or tasks at the limit) is replaced by ``_start_asgi_task``'s
        self.max_connections = self.limit_concurrency
        self.limit_concurrency = None
        self.max_head_bytes = config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD_BYTES
        self.head_timeout_s = float(config.timeout_keep_alive)
        self._reading_head = True
        self._head_bytes_seen = 0  # bytes received since the head began (an upper bound)
        self._head_bytes = 0  # bytes of request line and headers parsed (exact)
        self._head_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the head's deadline -----------------------------------------------------------------

    def _await_head(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    # -- the head's size ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._head_too_large:
            return
        if self._reading_head:
            self._head_bytes_seen += len(data)
        # the parser holds a header until it ends: bytes of an unfinished head are counted as they come
        with contextlib.suppress(_HeadTooLarge):
            super().data_received(data)
        if self._head_too_large or (self._reading_head and self._head_bytes_seen > self.max_head_bytes):
            self._refuse_head()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLarge  # stops the parser (reported by it as a callback error)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes_seen = 0

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:  # a refusal raised inside a parser callback arrives here
            return
        super().send_400_response(msg)

    def _refuse_head(self) -> None:
        self._head_too_large = True
        self._cancel_head_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                _response(
                    431,
                    "Request Header Fields Too Large",
                    f"The request line and headers exceed the limit of {self.max_head_bytes} bytes",
                    "header_too_large",
                )
            )
            self.transport.close()

    # -- over limit_concurrency --------------------------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            cycle.keep_alive = False
            app = _over_capacity
        super()._start_asgi_task(cycle, app)


def _reuse_port_socket(config: Config) -> socket.socket:
    """A listening socket of its own on ``config``'s host and port, bound with SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((config.host, config.port))
        sock.listen(config.backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


class ReusePortMultiprocess(Multiprocess):
    """uvicorn's worker supervisor, each worker listening on a socket of its own (SO_REUSEPORT).

    With one shared listening socket, whichever worker is awake accepts: under load every new
    connection went to the busy worker (eight keep-alive connections to ``--workers 2`` all landed
    on one, and the second core sat idle). With a socket per worker the kernel spreads connections
    over the workers by their address. uvicorn hands each new worker ``self.sockets``; here each
    read of it binds a fresh socket, and the supervisor closes its own copy once the worker has
    been started (the worker holds the socket from then on: a worker that dies takes its socket
    and the connections waiting on it away, and its replacement binds a new one).
    """

    def __init__(self, config: Config) -> None:
        self._handed: list[socket.socket] = []
        super().__init__(config, sockets=[])

    @property
    def sockets(self) -> list[socket.socket]:
        sock = _reuse_port_socket(self.config)
        self._handed.append(sock)
        return [sock]

    @sockets.setter
    def sockets(self, value: list[socket.socket]) -> None:
        """uvicorn's own assignment: the sockets are made per worker instead."""

    def _close_handed(self) -> None:
        while self._handed:
            self._handed.pop().close()

    def init_processes(self) -> None:
        try:
            super().init_processes()
        finally:
            self._close_handed()

    def restart_all(self) -> None:
        try:
            super().restart_all()
        finally:
            self._close_handed()

    def keep_subprocess_alive(self) -> None:
        try:
            super().keep_subprocess_alive()
        finally:
            self._close_handed()


def run_workers(app: str, workers: int, **options: Any) -> None:
    """``uvicorn.run(app, factory=True, workers=workers, **options)`` with a socket per worker."""
    config = Config(app, factory=True, workers=workers, **options)
    ReusePortMultiprocess(config).run()
