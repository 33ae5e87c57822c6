"""Remote vLLM workers (``XMARK_BACKEND=vllm``): the gateway's client side.

Each worker is a ``vllm serve`` OpenAI server running the XMark logits processor
(``xmark_core.vllm_v1`` / ``xmark_core.vllm_v2``). The gateway keeps one aiohttp ClientSession
(a pool of keep-alive connections) per worker, sends each request to the healthy worker with the
fewest requests in flight, and streams the worker's SSE deltas through as they arrive. aiohttp
rather than httpx: a streamed upstream request costs it about a quarter of httpx's CPU time
(docs/benchmarks.md, "The gateway's own cost"), and every completion is one.

* The watermark is the gateway's decision: the upstream body is built from the validated
  request alone, with the gateway's own ``vllm_xargs`` (the caller's message and the key
  version's name). Nothing the client sent is forwarded verbatim, so a client-supplied
  ``vllm_xargs`` never reaches a worker.
* Health: a background task polls every worker's ``/health``; a worker that fails a check or a
  connection is taken out of rotation and comes back once a check passes.
* Failures: no worker reachable -> 503 ``upstream_unavailable``; no answer within the timeout
  -> 504 ``upstream_timeout``. A request is retried on another worker only while nothing has
  been generated for it (connection refused or reset before the first token); once tokens
  have streamed it is never retried.
* ``/trace`` uses the tokenizer loaded from the same local checkpoint the workers serve, and
  ``score`` asks a worker for the text's prompt log-probs (``POST /v1/completions`` with the
  token ids as the prompt and ``prompt_logprobs``; no ``vllm_xargs``, so the XMark processor
  leaves the request alone, and vLLM computes prompt log-probs from the raw logits anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from service.backends.base import (
    LOAD_LOCK,
    ChoiceDelta,
    GenerationRequest,
    GenerationResult,
    WatermarkStamp,
    collect,
)
from service.backends.fields import DEFAULT_HONOURED
from service.errors import (
    GatewayError,
    InvalidRequestError,
    ServiceUnavailableError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
    scrub,
)
from service.vocabulary import FinishReason
from xmark_core.params import SCHEMES
from xmark_core.vllm_common import (  # the names the workers read
    ENCODER_COMPANION,
    XARG_ENCODER,
    XARG_FINGERPRINT,
    XARG_KEY_VERSION,
    XARG_MESSAGE,
    XARG_SALT,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from xmark_core import ModelScores

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
HEALTH_PATH = "/health"
HEALTH_TIMEOUT_S = 2.0
HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
# consecutive failed probes (no answer in time, or not 200) that take a worker in rotation out of it;
# a worker that refuses the connection leaves at once
PROBES_TO_LEAVE = 3
MAX_UPSTREAM_ERROR_CHARS = 500
MAX_WORKER_CONNECTIONS = 256  # open connections to one worker (more requests wait for one)
CONNECT_TIMEOUT_S = 5.0
MAX_EVENT_BYTES = 64 * 1024 * 1024  # one SSE line of a worker's stream
PROMPT_BOUND_SLACK = 8  # tokens a tokenizer may add beyond the text's bytes (see prompt_token_bound)
# vLLM's "This model's maximum context length is N tokens. However, ..."
_CONTEXT_LENGTH = re.compile(r"maximum context length is (\d+) tokens")

_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "tool_calls": FinishReason.TOOL_CALLS,
    "abort": FinishReason.CANCELLED,
}


def _origin(url: str) -> str:
    """scheme://host:port of a worker URL, for log lines (never credentials or paths)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


# what a lost or refused worker connection raises (a timeout is told apart first)
_CONNECTION_ERRORS = (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, OSError)


class _ConnectionFailed(Exception):
    """A request's connection to a worker failed before any answer (``_post``'s own signal)."""


@dataclass
class Worker:
    """One upstream vLLM server and what the gateway knows about it. ``session`` exists between
    the backend's ``start`` and ``close`` (aiohttp binds it to the running event loop)."""

    url: str
    session: aiohttp.ClientSession | None = None
    healthy: bool = False
    in_flight: int = 0
    served: int = 0
    # failed probes in a row (``WorkerPool.check``); a success resets it
    failed_probes: int = 0

    @property
    def origin(self) -> str:
        return _origin(self.url)

    @property
    def client(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise ServiceUnavailableError("The gateway is still starting; retry shortly")
        return self.session


class WorkerPool:
    """The workers, their health, and least-in-flight selection."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        if not workers:
            raise ValueError("at least one vLLM worker URL is required")
        self.workers = list(workers)

    def pick(self, exclude: set[str]) -> Worker | None:
        """The healthy worker with the fewest requests in flight (then the least used)."""
        candidates = [w for w in self.workers if w.healthy and w.url not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.in_flight, w.served))

    def mark(self, worker: Worker, healthy: bool) -> None:
        if worker.healthy != healthy:
            logger.warning(
                "vLLM worker %s",
                "back in rotation" if healthy else "taken out of rotation",
                extra={"worker": worker.origin},
            )
        worker.healthy = healthy

    async def check(self, worker: Worker) -> bool:
        """One health probe, bounded by HEALTH_TIMEOUT_S alone: the session's own bounds are the
        request timeout's, which may be far shorter than a busy worker needs to answer /health.
        Whether the worker is in rotation after it.

        A worker in rotation leaves only after ``PROBES_TO_LEAVE`` failed probes in a row (no
        answer in time, or an answer other than 200): a worker busy with a long batch on a loaded
        machine may miss a probe's bound and still serve, and with one worker its leaving turns
        every request into a 503. Within one probe a timeout is retried once: the gateway's own
        event loop may have stalled past the bound (a long garbage collection, the start-up heap
        freeze) with the worker's answer waiting unread. A worker that refuses the connection is
        gone and leaves at once; one out of rotation comes back on its first good probe.
        """
        refused = False
        for _ in range(2 if worker.healthy else 1):
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):
                    async with worker.client.get(worker.url + HEALTH_PATH, timeout=HEALTH_TIMEOUT) as response:
                        ok = response.status == 200
                break
            except TimeoutError:
                ok = False
            except (ServiceUnavailableError, *_CONNECTION_ERRORS):
                ok, refused = False, True
                break
        worker.failed_probes = 0 if ok else worker.failed_probes + 1
        if ok or refused or worker.failed_probes >= PROBES_TO_LEAVE or not worker.healthy:
            self.mark(worker, ok)
        elif worker.failed_probes == 1:
            logger.warning("vLLM worker missed a health probe; still in rotation", extra={"worker": worker.origin})
        return worker.healthy

    async def connection_failed(self, worker: Worker) -> bool:
        """A request's connection to ``worker`` failed before any answer: probe it now. Whether it
        is still in rotation (a stale keep-alive connection the worker had closed, or a worker
        that is only slow: the request may go to it again); a refused probe takes it out at once."""
        logger.warning("vLLM worker connection failed; probing it", extra={"worker": worker.origin})
        return await self.check(worker)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))


# OpenAI fields a vLLM worker honours that the gateway forwards as sent. Tool-call arguments and
# JSON answers are generated text: the watermark covers them like any content. Log-probabilities
# are the worker's raw ones (vLLM's default --logprobs-mode raw_logprobs: before every logits
# processor, the watermark included).
PASS_THROUGH_FIELDS = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "top_k",
        "min_p",
    }
)


JSON_HEADERS = {"Content-Type": "application/json"}


def _json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


_TOOL_FIELDS = frozenset({"tools", "tool_choice"})


def watermark_xargs(stamp: WatermarkStamp) -> dict[str, Any]:
    """The worker's arguments: the caller's message, the key version, the encoder the gateway chose
    (``xmark_encoder`` ``companion`` for a per-request version's biasing companion; absent: the
    primary), that encoder's fingerprint (a worker configured with another secret or other
    parameters refuses the request rather than write a watermark /trace cannot read) and, for a
    salted gumbel encoder, the answer's salt."""
    xargs: dict[str, Any] = {
        XARG_MESSAGE: stamp.message.bits,
        XARG_KEY_VERSION: stamp.key_version,
        XARG_FINGERPRINT: stamp.key.fingerprint,
    }
    if stamp.companion:
        xargs[XARG_ENCODER] = ENCODER_COMPANION
    elif stamp.key.params.distortion_free and stamp.key.params.salts > 1:
        xargs[XARG_SALT] = stamp.salt
    return xargs


def upstream_body(request: GenerationRequest, stamp: WatermarkStamp, model: str) -> dict[str, Any]:
    """The OpenAI request sent to a worker: the validated fields plus the gateway's watermark args."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "n": request.n,
        "stream": request.streamed,
        "return_token_ids": True,
        "vllm_xargs": watermark_xargs(stamp),
    }
    if request.streamed:
        body["stream_options"] = {"include_usage": True}
    if request.prompt is not None:  # POST /v1/completions
        body["prompt"] = request.prompt
    else:
        body["messages"] = [turn.as_message() for turn in request.messages]
    if request.stop:
        body["stop"] = list(request.stop)
    if request.seed is not None:
        body["seed"] = request.seed
    # the caller's further fields, as sent (vLLM validates them); never over the gateway's own
    for name, value in request.options.items():
        if name in PASS_THROUGH_FIELDS:
            body[name] = value
    return body


def _upstream_error_message(payload: Any, fallback: str) -> str:
    """vLLM's error text (it never holds our secrets), trimmed and scrubbed of credentials."""
    message = None
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            message = error.get("message")
        elif isinstance(error, str):
            message = error
    text = message if isinstance(message, str) and message else fallback
    return scrub(text[:MAX_UPSTREAM_ERROR_CHARS])


def _status_error(status: int, payload: Any) -> GatewayError:
    if status in (400, 422):
        return InvalidRequestError(
            _upstream_error_message(payload, "The model worker rejected the request"),
            code="invalid_request",
        )
    if status == 413:
        return InvalidRequestError("The request is too large for the model worker", code="payload_too_large")
    return UpstreamUnavailableError(f"The model worker answered HTTP {status}")


def score_body(token_ids: Sequence[int], top_k: int, model: str) -> dict[str, Any]:
    """The scoring request: the text's token ids as the prompt, its top-k prompt log-probs, one
    greedy token (vLLM generates at least one), and no ``vllm_xargs`` (so no watermark)."""
    return {"model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0, "prompt_logprobs": top_k}


def scores_from_completion(payload: Any, token_ids: Sequence[int], top_k: int, vocab_size: int) -> ModelScores:
    """ModelScores from vLLM's completion response.

    ``choices[0].prompt_logprobs`` has one entry per prompt token: None for the first, then a dict
    token id (a string in JSON) -> {"logprob", "rank", "decoded_token"} holding the top-k tokens
    and the prompt's own token (one more entry when that token is outside the top k).
    """
    from xmark_core import ModelScores

    n = len(token_ids)
    own = np.full(n, np.nan)
    top_ids = np.zeros((n, top_k), dtype=np.int64)
    top_logprobs = np.full((n, top_k), -np.inf)
    try:
        rows = payload["choices"][0]["prompt_logprobs"]
        if len(rows) != n:
            raise ValueError("one entry per prompt token expected")
        for t in range(1, n):
            entries = {int(token): float(entry["logprob"]) for token, entry in rows[t].items()}
            own[t] = entries[int(token_ids[t])]
            best = sorted(entries.items(), key=lambda item: -item[1])[:top_k]
            if len(best) < top_k:
                raise ValueError("fewer than top_k tokens")
            top_ids[t] = [token for token, _ in best]
            top_logprobs[t] = [logprob for _, logprob in best]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise UpstreamUnavailableError("The model worker answered with malformed log-probabilities") from None
    return ModelScores(token_logprobs=own, top_ids=top_ids, top_logprobs=top_logprobs, vocab_size=vocab_size)


def _score_rejected(upstream_message: str, tokens: int) -> InvalidRequestError:
    """A worker's 400 to a scoring request: only the text can be at fault (the rest is ours)."""
    if "context length" in upstream_message:
        limit = _CONTEXT_LENGTH.search(upstream_message)
        most = f"at most {limit.group(1)}" if limit else "fewer"
        message = f"The text has {tokens} tokens; the model reads {most}"
        return InvalidRequestError(message, param="text", code="context_length_exceeded")
    return InvalidRequestError(f"The model worker could not score the text: {upstream_message}", param="text")


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines, each at most MAX_EVENT_BYTES (aiohttp's own line limit, 128 KiB, is below
    a first event that carries a long prompt's token ids)."""
    while line := await content.readuntil(b"\n", max_size=MAX_EVENT_BYTES):
        yield line


class VllmStream:
    """The deltas of one upstream SSE response, as the gateway's ChoiceDelta values."""

    def __init__(
        self, pool: WorkerPool, worker: Worker, response: aiohttp.ClientResponse, n: int, *, timeout_s: float
    ) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._worker = worker
        self._response = response
        self._lines: AsyncIterator[bytes] = _lines(response.content)
        self._tokens = [0] * n
        self._open = set(range(n))
        self._pending: deque[ChoiceDelta] = deque()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self.prompt_tokens = 0
        self.connection_lost = False

    def __aiter__(self) -> VllmStream:
        return self

    async def prime(self) -> None:
        """Read up to the first chunk (the worker has admitted the request and produced a token)."""
        while not self._pending and self._open:
            if not await self._read_event():
                break

    async def __anext__(self) -> ChoiceDelta:
        while not self._pending:
            if not self._open:
                while await self._read_event():  # the usage chunk, then [DONE]
                    pass
                await self.aclose()
                raise StopAsyncIteration
            if not await self._read_event():
                await self.aclose()
                if self._open:
                    self._open.clear()
                    raise UpstreamUnavailableError("The model worker ended the stream early")
        return self._pending.popleft()

    async def _read_event(self) -> bool:
        """Consume one SSE data line; False at the end of the stream."""
        try:
            while True:
                # the wait for each read is bounded by the session's sock_read timeout (aiohttp's
                # own timer, moved on as data arrives): no timer of our own per event
                line = await anext(self._lines, None)
                if line is None:
                    return False
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    # read to the end of the body (the chunked terminator): only a response read
                    # to its end goes back to the pool as a keep-alive connection
                    async for _ in self._lines:
                        pass
                    return False
                self._handle(json.loads(data))
                return True
        except TimeoutError:
            await self.aclose()
            raise UpstreamTimeoutError("The model worker did not answer in time") from None
        except (*_CONNECTION_ERRORS, ValueError):  # ValueError: a malformed event (JSONDecodeError)
            self.connection_lost = True
            await self.aclose()
            await self._pool.connection_failed(self._worker)  # a worker that is gone leaves rotation
            raise UpstreamUnavailableError("The connection to the model worker was lost") from None
        except BaseException:
            await self.aclose()
            raise

    def _handle(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            raise UpstreamUnavailableError(_upstream_error_message(chunk, "The model worker failed"))
        if self.prompt_tokens == 0 and chunk.get("prompt_token_ids"):
            self.prompt_tokens = len(chunk["prompt_token_ids"])
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("prompt_tokens"):
            self.prompt_tokens = int(usage["prompt_tokens"])
        for choice in chunk.get("choices") or ():
            index = int(choice["index"])
            if index not in self._open:
                continue
            self._tokens[index] += len(choice.get("token_ids") or ())
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""  # chat, or /v1/completions
            tool_calls = tuple(delta.get("tool_calls") or ())
            logprobs = tuple((choice.get("logprobs") or {}).get("content") or ())
            reason = _finish_reason(choice.get("finish_reason"))
            if reason is not None:
                self._open.discard(index)
            if text or tool_calls or logprobs or reason is not None or choice.get("token_ids"):
                stop = _stop_sequence(reason, choice)
                self._pending.append(ChoiceDelta(index, text, self._tokens[index], reason, tool_calls, logprobs, stop))

    async def aclose(self) -> None:
        """End the response: a stream read to its end hands its connection back to the pool; one
        left midway closes its connection (vLLM aborts the request)."""
        if self._closed:
            return
        self._closed = True
        self._worker.in_flight -= 1
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()

    @property
    def upstream_closed(self) -> bool:
        """True once the upstream response is closed (vLLM aborts a request whose client left)."""
        return self._closed

    def cancel(self) -> None:
        """Stop generating: closing the upstream response makes vLLM abort the request."""
        if self._closed or self._close_task is not None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing left to close from
            self._close_task = asyncio.get_running_loop().create_task(self.aclose())


def _finish_reason(raw: Any) -> FinishReason | None:
    if raw is None:
        return None
    if raw == "error":
        raise UpstreamUnavailableError("The model worker failed while generating")
    return _FINISH_REASONS.get(raw, FinishReason.STOP)


def _stop_sequence(reason: FinishReason | None, choice: dict[str, Any]) -> str | None:
    """The stop string that ended a choice: vLLM's ``stop_reason`` (a stop token's id, or None at
    the end of the turn, otherwise)."""
    stop = choice.get("stop_reason")
    return stop if reason is FinishReason.STOP and isinstance(stop, str) else None


def deltas_from_completion(payload: Any, n: int) -> tuple[int, list[ChoiceDelta]]:
    """A worker's non-streamed answer as (prompt tokens, one whole delta per choice)."""
    try:
        usage = payload.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or len(payload.get("prompt_token_ids") or ()))
        deltas = []
        for choice in payload["choices"]:
            index = int(choice["index"])
            if not 0 <= index < n:
                continue
            message = choice.get("message") or {}
            text = message.get("content") or choice.get("text") or ""  # chat, or /v1/completions
            # whole calls: each one's position in the list is the index a streamed delta would carry
            tool_calls = tuple({**call, "index": k} for k, call in enumerate(message.get("tool_calls") or ()))
            logprobs = tuple((choice.get("logprobs") or {}).get("content") or ())
            tokens = len(choice.get("token_ids") or ())
            if not tokens and n == 1:  # a worker that does not return token ids: the usage is this choice's
                tokens = int(usage.get("completion_tokens") or 0)
            reason = _finish_reason(choice.get("finish_reason")) or FinishReason.STOP
            deltas.append(
                ChoiceDelta(index, text, tokens, reason, tool_calls, logprobs, _stop_sequence(reason, choice))
            )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UpstreamUnavailableError("The model worker answered with a malformed completion") from None
    return prompt_tokens, deltas


class WholeCompletion:
    """A worker's non-streamed answer, already complete, as a GenerationStream of one delta per
    choice (a client that does not stream gets one parse of one JSON body instead of an SSE event
    per token)."""

    def __init__(self, prompt_tokens: int, deltas: list[ChoiceDelta]) -> None:
        self.prompt_tokens = prompt_tokens
        self._pending = deque(deltas)

    def __aiter__(self) -> WholeCompletion:
        return self

    async def __anext__(self) -> ChoiceDelta:
        if not self._pending:
            raise StopAsyncIteration
        return self._pending.popleft()

    def cancel(self) -> None:
        """Nothing to stop: the worker has finished (a client that left earlier closed the request)."""


@dataclass
class _Lifecycle:
    health_task: asyncio.Task[None] | None = None
    tokenizer_task: asyncio.Task[None] | None = None
    closed: bool = False


class VllmBackend:
    """Chat completions served by one or more vLLM workers."""

    honoured_fields = DEFAULT_HONOURED | PASS_THROUGH_FIELDS
    # every scheme: the workers' processors bias logits with a biasing key and sample with a
    # ``gumbel`` key (xmark_core.vllm_v1 / vllm_v2)
    schemes = frozenset(SCHEMES)
    # the n answers of one request reach a worker as child requests with one salt
    salts_per_answer = False
    # the workers serve both encoders of a per-request key version, the one ``xmark_encoder`` names
    encoders_per_request = True

    def __init__(
        self,
        urls: Sequence[str],
        model_id: str,
        tokenizer_path: Path,
        *,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        health_interval_s: float = 5.0,
    ) -> None:
        if not urls:
            raise ValueError("XMARK_VLLM_URLS must name at least one worker")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model_id = model_id
        self._tokenizer_path = tokenizer_path
        self._health_interval_s = health_interval_s
        self._timeout_s = timeout_s
        self._whole_timeout = aiohttp.ClientTimeout(total=None, connect=min(CONNECT_TIMEOUT_S, timeout_s))
        self._pool = WorkerPool([Worker(url=url.rstrip("/")) for url in urls])
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._vocab_size = 0  # the model's logits width, from the checkpoint's config
        self._state = _Lifecycle()
        self.load_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once the tokenizer is loaded; worker outages surface per request as 503."""
        return self._tokenizer is not None and not self._state.closed

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def _session(self) -> aiohttp.ClientSession:
        """A worker's connection pool: at most MAX_WORKER_CONNECTIONS open, kept alive between
        requests; each wait is bounded by the backend's timeout (the connect by CONNECT_TIMEOUT_S)."""
        connector = aiohttp.TCPConnector(
            limit=MAX_WORKER_CONNECTIONS, limit_per_host=MAX_WORKER_CONNECTIONS, enable_cleanup_closed=False
        )
        # sock_read: the longest wait for the worker's next bytes (its answer's head, each token)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=min(CONNECT_TIMEOUT_S, self._timeout_s), sock_read=self._timeout_s
        )
        return aiohttp.ClientSession(
            connector=connector, headers=self._headers, timeout=timeout, raise_for_status=False, auto_decompress=False
        )

    async def start(self) -> None:
        if self._state.health_task is not None:
            return
        for worker in self._pool.workers:
            if worker.session is None:
                worker.session = self._session()
        self._state.tokenizer_task = asyncio.create_task(self._load_tokenizer())
        await self._pool.check_all()
        self._state.health_task = asyncio.create_task(self._watch_health())

    async def wait_ready(self, timeout: float | None = None) -> bool:
        task = self._state.tokenizer_task
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        return self.ready

    async def _load_tokenizer(self) -> None:
        def load() -> PreTrainedTokenizerBase:
            # transformers' (lazy) imports and loading are not thread-safe: another backend's
            # tokenizer may be loading on another thread
            with LOAD_LOCK:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(self._tokenizer_path, local_files_only=True)

        def vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
            """config.json's vocab_size (the logits width, which may exceed the tokenizer's length)."""
            with contextlib.suppress(OSError, ValueError):
                size = json.loads((self._tokenizer_path / "config.json").read_text()).get("vocab_size")
                if isinstance(size, int) and size >= len(tokenizer):
                    return size
            return len(tokenizer)

        try:
            tokenizer = await asyncio.to_thread(load)
            self._vocab_size = vocab_size(tokenizer)
            self._tokenizer = tokenizer
        except Exception as exc:
            self.load_error = type(exc).__name__
            logger.error("tokenizer failed to load", extra={"error_type": type(exc).__name__})

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self._pool.check_all()
            except Exception as exc:
                logger.warning("health check failed", extra={"error_type": type(exc).__name__})

    async def close(self) -> None:
        self._state.closed = True
        for task in (self._state.health_task, self._state.tokenizer_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for worker in self._pool.workers:
            if worker.session is not None:
                await worker.session.close()

    # -- requests ----------------------------------------------------------------------------

    def _ready_tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = self._tokenizer
        if tokenizer is None or self._state.closed:
            raise ServiceUnavailableError("The gateway is still starting; retry shortly")
        return tokenizer

    @staticmethod
    def _rendered(tokenizer: PreTrainedTokenizerBase, request: GenerationRequest) -> str:
        """The prompt as the worker sees it before tokenizing: the chat template applied (with the
        tools' definitions, wherever the template renders them), or a completion's prompt."""
        if request.prompt is not None:  # /v1/completions: the worker adds no template either
            return request.prompt
        conversation = [turn.as_template_message() for turn in request.messages]
        rendered: Any = tokenizer.apply_chat_template(
            conversation, tools=request.options.get("tools"), add_generation_prompt=True, tokenize=False
        )
        return str(rendered)

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt's tokens by the gateway's copy of the served checkpoint's tokenizer and chat
        template (the workers apply the same), counted off the event loop; no worker round trip."""
        tokenizer = self._ready_tokenizer()

        def count() -> int:
            text = self._rendered(tokenizer, request)
            # a completion's prompt gets the tokenizer's own special tokens (BOS), as on the worker
            return len(tokenizer(text, add_special_tokens=request.prompt is not None)["input_ids"])

        return await asyncio.to_thread(count)

    async def prompt_token_bound(self, request: GenerationRequest) -> int:
        """The rendered prompt's UTF-8 length plus ``PROMPT_BOUND_SLACK``, with no tokenizing.

        Every token of a byte-level BPE or SentencePiece tokenizer stands for at least one byte of
        the text (a special token such as ``<|im_start|>`` for many), so a prompt of B bytes has at
        most B tokens; the slack covers what a tokenizer adds that is not in the text (a BOS token,
        SentencePiece's leading space). Rendering a short chat costs tens of microseconds on the
        event loop, tokenizing it a hundred and a thread hop; a prompt whose bound meets a limit is
        then counted exactly (``count_prompt_tokens``)."""
        return len(self._rendered(self._ready_tokenizer(), request).encode()) + PROMPT_BOUND_SLACK

    async def stream(self, request: GenerationRequest, stamp: WatermarkStamp) -> VllmStream | WholeCompletion:
        """The worker's stream, or (``request.streamed`` False) its whole answer: a client that does
        not stream is served by a non-streamed upstream request (unless it sends tools). Leaving while it runs (this
        coroutine cancelled) closes the upstream connection, and vLLM aborts the request."""
        if not self.ready:
            raise ServiceUnavailableError("The gateway is still starting; retry shortly")
        if not request.streamed and _TOOL_FIELDS & request.options.keys():
            # tools keep the stream: vLLM's non-streamed answer to a named tool choice came back as
            # text with no tool call (tests/e2e_vllm), where its stream carries the call
            request = dataclasses.replace(request, streamed=True)
        body = upstream_body(request, stamp, self.model_id)
        path = CHAT_PATH if request.prompt is None else COMPLETIONS_PATH
        tried: set[str] = set()
        while True:
            worker = self._pool.pick(tried)
            if worker is None:
                raise UpstreamUnavailableError("No model worker is available; retry shortly")
            tried.add(worker.url)
            if not request.streamed:
                payload = await self._post(worker, path, body, whole=True)
                if payload is not None:
                    return WholeCompletion(*deltas_from_completion(payload, request.n))
                continue
            stream = await self._open(worker, body, request.n, path)
            if stream is not None:
                return stream

    async def _open(self, worker: Worker, body: dict[str, Any], n: int, path: str) -> VllmStream | None:
        """Send ``body`` to ``worker`` and read up to its first token; None: try another worker.
        A connection that fails before any token is tried once more on the same worker when a
        probe finds it still in rotation (``WorkerPool.connection_failed``)."""
        for attempt in (1, 2):
            stream = await self._open_once(worker, body, n, path)
            if stream is not None or attempt == 2 or not worker.healthy:
                return stream
        return None

    async def _open_once(self, worker: Worker, body: dict[str, Any], n: int, path: str) -> VllmStream | None:
        worker.in_flight += 1
        worker.served += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await worker.client.post(worker.url + path, data=_json_bytes(body), headers=JSON_HEADERS)
        except TimeoutError:
            worker.in_flight -= 1
            raise UpstreamTimeoutError("The model worker did not answer in time") from None
        except _CONNECTION_ERRORS:
            worker.in_flight -= 1
            await self._pool.connection_failed(worker)
            return None
        except BaseException:
            worker.in_flight -= 1
            raise
        if response.status != 200:
            try:
                async with asyncio.timeout(self._timeout_s):
                    payload: Any = json.loads(await response.read())
            except (TimeoutError, ValueError, *_CONNECTION_ERRORS):
                payload = None
            finally:
                response.close()
                worker.in_flight -= 1
            error = self._refusal(worker, response.status, payload)
            if error is None:
                return None
            raise error
        stream = VllmStream(self._pool, worker, response, n, timeout_s=self._timeout_s)
        try:
            await stream.prime()
        except UpstreamUnavailableError:
            if stream.connection_lost:  # dropped before any token: nothing was generated
                return None
            raise
        return stream

    def _refusal(self, worker: Worker, status: int, payload: Any) -> GatewayError | None:
        """A worker's non-200 answer: the error to raise, or None (503: out of rotation, try another)."""
        logger.warning("vLLM worker refused a request", extra={"worker": worker.origin, "status": status})
        if status == 503:
            self._pool.mark(worker, False)
            return None
        return _status_error(status, payload)

    async def generate(self, request: GenerationRequest, stamp: WatermarkStamp) -> GenerationResult:
        return await collect(await self.stream(request, stamp), request.n)

    async def score(self, token_ids: Sequence[int], top_k: int) -> ModelScores:
        """The text's prompt log-probs from a worker (see ``scores_from_completion``)."""
        if not self.ready:
            raise ServiceUnavailableError("The gateway is still starting; retry shortly")
        body = score_body([int(t) for t in token_ids], top_k, self.model_id)
        tried: set[str] = set()
        while True:
            worker = self._pool.pick(tried)
            if worker is None:
                raise UpstreamUnavailableError("No model worker is available; retry shortly")
            tried.add(worker.url)
            try:
                payload = await self._post(worker, COMPLETIONS_PATH, body)
            except InvalidRequestError as exc:  # the body is ours but for the text: its length
                raise _score_rejected(exc.message, len(body["prompt"])) from None
            if payload is not None:
                return scores_from_completion(payload, body["prompt"], top_k, self._vocab_size)

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path`` of the healthy worker with the fewest requests in flight and
        return its JSON answer (another route of the workers than a generation's, e.g. the
        ``/v1/embeddings`` of a pooling model). A worker whose connection fails leaves the rotation
        and the next is tried; none left: 503 ``upstream_unavailable`` at once; no answer within
        the timeout: 504 ``upstream_timeout``; a worker's refusal: its ``_status_error``."""
        if not self.ready:
            raise ServiceUnavailableError("The gateway is still starting; retry shortly")
        tried: set[str] = set()
        while True:
            worker = self._pool.pick(tried)
            if worker is None:
                raise UpstreamUnavailableError("No model worker is available; retry shortly")
            tried.add(worker.url)
            payload = await self._post(worker, path, body)
            if payload is not None:
                return payload

    async def _post(self, worker: Worker, path: str, body: dict[str, Any], *, whole: bool = False) -> Any | None:
        """POST ``body`` to ``worker`` and return its JSON answer; None: try another worker.

        ``whole``: a non-streamed generation, whose answer comes only once every token exists; the
        backend's timeout then bounds the connect alone, and the request's own deadline (the
        caller's, ``request_timeout_s``) the rest. A connection that fails is tried once more on
        the same worker when a probe finds it still in rotation (``WorkerPool.connection_failed``)."""
        for attempt in (1, 2):
            try:
                return await self._post_once(worker, path, body, whole=whole)
            except _ConnectionFailed:
                if attempt == 2 or not await self._pool.connection_failed(worker):
                    return None
        return None

    async def _post_once(self, worker: Worker, path: str, body: dict[str, Any], *, whole: bool) -> Any | None:
        worker.in_flight += 1
        worker.served += 1
        try:
            async with asyncio.timeout(None if whole else self._timeout_s):
                options: dict[str, Any] = {"timeout": self._whole_timeout} if whole else {}
                async with worker.client.post(
                    worker.url + path, data=_json_bytes(body), headers=JSON_HEADERS, **options
                ) as response:
                    status = response.status
                    content = await response.read()
        except TimeoutError:
            raise UpstreamTimeoutError("The model worker did not answer in time") from None
        except _CONNECTION_ERRORS:
            raise _ConnectionFailed from None
        finally:
            worker.in_flight -= 1
        try:
            payload: Any = json.loads(content)
        except ValueError:
            if status == 200:
                raise UpstreamUnavailableError("The model worker answered with malformed JSON") from None
            payload = None
        if status != 200:
            error = self._refusal(worker, status, payload)
            if error is None:
                return None
            raise error
        return payload
