"""A fake OpenAI-compatible model server for gateway benchmarks: answers in microseconds.

It speaks just enough of vLLM's OpenAI server for the gateway's vLLM backend and for any OpenAI
client: ``POST /v1/chat/completions`` (and ``/v1/completions``), streamed (SSE: one chunk per
token, a usage chunk, ``[DONE]``; the token ids vLLM adds with ``return_token_ids``) or not,
``GET /health`` and ``GET /v1/models``. Every answer is the same ``--tokens`` tokens, prepared
once at start-up, so the server's cost per request is parsing a request head and writing a few
prepared bytes: a raw asyncio protocol with the C HTTP parser (httptools) on uvloop, no
framework. A request's body is read only for ``"stream": true``.

    python -m benchmarks.fake_upstream --port 8000 [--tokens 16] [--processes 2]

With ``--processes N`` N processes share the port (``SO_REUSEPORT``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import time
from typing import Any, cast

import httptools

try:
    import uvloop
except ImportError:  # pragma: no cover - not on this platform
    uvloop = None  # type: ignore[assignment]

WORDS = ("Hello", " there", ",", " how", " can", " I", " help", " you", " today", "?")


def _chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class Answers:
    """The prepared response bytes (head and body) for each kind of request."""

    def __init__(self, tokens: int, model: str = "fake") -> None:
        created = int(time.time())
        pieces = [WORDS[i % len(WORDS)] for i in range(tokens)]
        text = "".join(pieces)
        usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
        completion = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }
        self.chat = self._plain(json.dumps(completion, separators=(",", ":")).encode())
        text_completion = {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
            "usage": usage,
        }
        self.completion = self._plain(json.dumps(text_completion, separators=(",", ":")).encode())
        self.chat_stream = self._stream(pieces, model, usage, chat=True)
        self.completion_stream = self._stream(pieces, model, usage, chat=False)
        self.health = self._plain(b"")
        models = {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "fake"}]}
        self.models = self._plain(json.dumps(models).encode())
        self.not_found = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"

    @staticmethod
    def _plain(body: bytes) -> bytes:
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        return head.encode() + body

    @staticmethod
    def _stream(pieces: list[str], model: str, usage: dict[str, int], *, chat: bool) -> list[bytes]:
        """The stream as HTTP/1.1 chunks: the head, then one transfer chunk per SSE event."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "chatcmpl-fake", "object": kind, "created": int(time.time()), "model": model}
        events: list[bytes] = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None, "token_ids": [100 + i]}
            if chat:
                choice["delta"] = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            else:
                choice["text"] = piece
            payload: dict[str, Any] = {**base, "choices": [choice]}
            if i == 0:
                payload["prompt_token_ids"] = list(range(usage["prompt_tokens"]))
            events.append(_chunk(payload))
        events.append(_chunk({**base, "choices": [], "usage": usage}))
        events.append(b"data: [DONE]\n\n")
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        framed = [head] + [f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in events] + [b"0\r\n\r\n"]
        return framed


class FakeProtocol(asyncio.Protocol):
    def __init__(self, answers: Answers, delay_s: float) -> None:
        self._answers = answers
        self._delay_s = delay_s
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self._transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None:
            return
        path = self._url.split(b"?", 1)[0]
        answers = self._answers
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            chat = path == b"/v1/chat/completions"
            body = b"".join(self._body)
            if b'"stream":true' in body.replace(b" ", b""):
                chunks = answers.chat_stream if chat else answers.completion_stream
                if self._delay_s:
                    asyncio.get_running_loop().create_task(self._paced(transport, chunks))
                else:
                    transport.writelines(chunks)
                return
            transport.write(answers.chat if chat else answers.completion)
        elif path == b"/health":
            transport.write(answers.health)
        elif path == b"/v1/models":
            transport.write(answers.models)
        else:
            transport.write(answers.not_found)

    async def _paced(self, transport: asyncio.Transport, chunks: list[bytes]) -> None:
        transport.write(chunks[0])
        for chunk in chunks[1:]:
            await asyncio.sleep(self._delay_s)
            if transport.is_closing():
                return
            transport.write(chunk)


def serve(port: int, tokens: int, delay_s: float, host: str = "127.0.0.1") -> None:
    """Serve until SIGTERM/SIGINT (one process)."""
    if uvloop is not None:
        uvloop.install()
    answers = Answers(tokens)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(4096)
        server = await loop.create_server(lambda: FakeProtocol(answers, delay_s), sock=sock)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=16, help="tokens in every answer")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="pause between streamed chunks")
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    if args.processes <= 1:
        serve(args.port, args.tokens, args.delay_ms / 1000, args.host)
        return
    children = [
        multiprocessing.Process(target=serve, args=(args.port, args.tokens, args.delay_ms / 1000, args.host))
        for _ in range(args.processes)
    ]
    for child in children:
        child.start()

    def forward(*_: object) -> None:
        for child in children:
            if child.pid:
                os.kill(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    for child in children:
        child.join()


if __name__ == "__main__":
    main()
