"""A lean closed-loop HTTP/1.1 load generator for gateway benchmarks (its own process).

``--concurrency`` keep-alive connections each send the same prepared request again as soon as the
previous answer has ended, for ``--seconds``; the first ``--warmup`` seconds are not counted. Each
connection is a raw asyncio protocol with the C HTTP parser (httptools) on uvloop, so the client's
own cost per request stays far below any gateway's. Per request it records the latency (request
written to the last byte read), the time to the first body byte (a stream's first chunk) and the
number of SSE events; answers other than 2xx are counted by status. Prints one JSON object:

    {"requests", "answered", "seconds", "rps", "tokens", "tokens_per_s", "errors": {status: count}, "transport_errors",
     "latency_ms": {"p50", "p95", "p99", "mean"}, "ttfb_ms": {...}, "events_per_request",
     "per_event_ms"}

    python -m benchmarks.loadgen --url http://127.0.0.1:8080/v1/chat/completions \
        --body '{"model": "m", "messages": [...]}' --header 'authorization: Bearer sk-...' \
        --concurrency 16 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import numpy as np

try:
    import uvloop
except ImportError:  # pragma: no cover - not on this platform
    uvloop = None  # type: ignore[assignment]

CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Tally:
    measuring: bool = False
    latency: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    seconds: float = 0.0  # the measured span
    connections: int = 0  # connections opened (a closed-loop client on keep-alive opens `concurrency`)
    answered: int = 0  # every answer, warm-up included (what the target's CPU time was spent on)
    count_tokens: bool = False
    error_samples: dict[int, str] = field(default_factory=dict)  # the first body of each non-2xx status
    tokens: int = 0  # completion tokens of the measured 2xx answers (with count_tokens)


class Connection(asyncio.Protocol):
    """One keep-alive connection sending ``request`` in a loop."""

    def __init__(self, request: bytes, tally: Tally) -> None:
        self._request = request
        self._tally = tally
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[bool] | None = None
        self._sent = 0.0
        self._first = 0.0
        self._events = 0
        self._status = 0
        self._keep_alive = False
        self._body: list[bytes] = []
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(False)
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def on_body(self, body: bytes) -> None:
        if not self._first:
            self._first = time.perf_counter()
        self._events += body.count(b"data:")
        if self._tally.count_tokens or self._parser.get_status_code() >= 300:
            self._body.append(body)

    def on_message_complete(self) -> None:
        end = time.perf_counter()
        self._status = self._parser.get_status_code()
        # only meaningful inside the parser's callbacks: after them httptools answers False
        self._keep_alive = self._parser.should_keep_alive()
        self._tally.answered += 1
        if self._status >= 300 and self._status not in self._tally.error_samples:
            self._tally.error_samples[self._status] = b"".join(self._body)[:300].decode(errors="replace")
        if self._tally.measuring:
            self._tally.statuses[self._status] += 1
            if 200 <= self._status < 300:
                self._tally.latency.append(end - self._sent)
                self._tally.ttfb.append((self._first or end) - self._sent)
                self._tally.events.append(self._events)
                if self._tally.count_tokens:
                    self._tally.tokens += completion_tokens(b"".join(self._body))
        if self._done is not None and not self._done.done():
            self._done.set_result(True)

    async def one(self) -> bool:
        """Send the request once and wait for its whole answer; False if the connection ended."""
        assert self._transport is not None
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._first = 0.0
        self._events = 0
        self._body = []
        self._sent = time.perf_counter()
        self._transport.write(self._request)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                ok = await self._done
        except TimeoutError:
            self._transport.close()
            return False
        if not self._keep_alive:
            self._transport.close()
            return False
        return ok


def completion_tokens(body: bytes) -> int:
    """A completion's ``usage.completion_tokens`` (a stream: its usage chunk, else its content chunks)."""
    if body.lstrip().startswith(b"{"):
        return int(json.loads(body).get("usage", {}).get("completion_tokens", 0))
    contents = 0
    for line in body.split(b"\n"):
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if event.get("usage"):
            return int(event["usage"].get("completion_tokens", 0))
        contents += sum(1 for choice in event.get("choices", ()) if (choice.get("delta") or {}).get("content"))
    return contents


def prepare(url: str, body: bytes, headers: list[str]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path or "/"
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "content-type: application/json"]
    lines += headers
    lines.append(f"content-length: {len(body)}")
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def run(
    url: str, body: bytes, headers: list[str], concurrency: int, seconds: float, warmup: float, count_tokens: bool
) -> Tally:
    host, port, request = prepare(url, body, headers)
    tally = Tally(count_tokens=count_tokens)
    loop = asyncio.get_running_loop()
    stop_at = time.perf_counter() + warmup + seconds

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    _, conn = await loop.create_connection(lambda: Connection(request, tally), host, port)
            except (OSError, TimeoutError):
                if tally.measuring:
                    tally.transport_errors += 1
                await asyncio.sleep(0.05)
                continue
            tally.connections += 1
            while time.perf_counter() < stop_at:
                if not await conn.one():
                    if tally.measuring and conn._status == 0:
                        tally.transport_errors += 1
                    break
            if conn._transport is not None:
                conn._transport.close()

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    tally.measuring = True
    started = time.perf_counter()
    await asyncio.gather(*tasks)
    tally.measuring = False
    tally.seconds = time.perf_counter() - started
    return tally


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan"), "mean": float("nan")}
    ms = np.asarray(values) * 1000
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(ms.mean())}


def summary(tally: Tally) -> dict[str, Any]:
    seconds = tally.seconds
    ok = len(tally.latency)
    errors = {str(status): count for status, count in tally.statuses.items() if not 200 <= status < 300}
    events = float(np.mean(tally.events)) if tally.events else 0.0
    per_event = [
        (lat - first) / (n - 1) for lat, first, n in zip(tally.latency, tally.ttfb, tally.events, strict=True) if n > 1
    ]
    return {
        "requests": ok,
        "answered": tally.answered,
        "seconds": seconds,
        "tokens": tally.tokens,
        "tokens_per_s": tally.tokens / seconds if seconds else 0.0,
        "busy_s": float(sum(tally.latency)),  # the measured requests' latencies, summed
        "rps": ok / seconds if seconds else 0.0,
        "errors": errors,
        "transport_errors": tally.transport_errors,
        "connections": tally.connections,
        "error_samples": {str(status): body for status, body in tally.error_samples.items()},
        "latency_ms": _percentiles(tally.latency),
        "ttfb_ms": _percentiles(tally.ttfb),
        "events_per_request": events,
        "per_event_ms": _percentiles(per_event)["p50"] if per_event else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True, help="the request body (JSON text)")
    parser.add_argument("--header", action="append", default=[], help="'name: value', repeatable")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--count-tokens", action="store_true", help="read each answer's completion tokens")
    args = parser.parse_args()
    if uvloop is not None:
        uvloop.install()
    tally = asyncio.run(
        run(args.url, args.body.encode(), args.header, args.concurrency, args.seconds, args.warmup, args.count_tokens)
    )
    print(json.dumps(summary(tally)))


if __name__ == "__main__":
    main()
