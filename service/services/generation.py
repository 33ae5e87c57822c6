"""Chat completions: validate, stamp with the caller's watermark, generate, record, respond.

Every completion is watermarked with the message ID of the authenticated caller under the
active key version; requests cannot change either. Every choice is recorded in the
generations table (one row per choice, streamed ones included, also when the client goes away
midway: then the row holds what was sent and the finish reason ``cancelled``). The completion
text is kept only when ``retain_completions`` is set; its SHA-256 always is.

The rows of a completion are written by one INSERT committed on its own (``RowWriter``: on
PostgreSQL a prepared statement over a connection kept for these writes), issued only once the
text exists: no transaction stays open while the model generates. They are written
as the response ends, however it ends (sent, client gone, request cancelled): a non-streamed
completion is sent as soon as it exists, a stream as it is generated. A write that fails is
retried, then counted and logged; a non-streamed completion's rows first linger
``record_linger_ms`` (group commit). With ``record_before_response`` a non-streamed completion is
sent only once its rows have committed (one database round trip more before the text).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from service.backends.base import (
    ChatTurn,
    ChoiceResult,
    GenerationRequest,
    GenerationResult,
    GenerationStream,
    WatermarkStamp,
)
from service.db import RowWriter
from service.errors import (
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
from service.models import utcnow
from service.schemas.chat import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    ChunkDelta,
    ModelCard,
    ModelList,
    Usage,
)
from service.schemas.common import Principal
from service.vocabulary import FinishReason
from xmark_core import Message

if TYPE_CHECKING:
    from service.backends import Backend
    from service.config import Settings
    from service.keyring import Keyring
    from service.metrics import Metrics

OWNED_BY = "xmark-gateway"

logger = logging.getLogger("xmark.generation")

# Pauses before the second and third attempt at writing the rows of a completion already sent
# (a restarting database, a dropped pooled connection). The last failure is counted and logged.
RECORD_RETRY_PAUSES_S = (0.2, 1.0)


@dataclass(frozen=True)
class CompletedChat:
    """A non-streamed completion, ready to send. ``model_ms``: the backend's share of the request.
    ``after`` (unless None) writes its generation rows; the caller runs it once the response has
    been handed to the server, also when sending failed or the request was cancelled meanwhile."""

    completion: ChatCompletion
    model_ms: float
    after: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class EndOfStream:
    """The last item of ``GenerationService.stream_chunks`` when the stream ended normally."""


@dataclass(frozen=True)
class PreparedCompletion:
    """A validated request with the identity it is generated for."""

    request_id: str
    created: int
    model: str
    request: GenerationRequest
    stamp: WatermarkStamp
    key_version_id: int
    principal: Principal


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class GenerationService:
    def __init__(
        self,
        records: RowWriter,
        settings: Settings,
        backend: Backend,
        keyring: Keyring,
        metrics: Metrics,
    ) -> None:
        self._records = records
        self._settings = settings
        self._backend = backend
        self._keyring = keyring
        self._metrics = metrics

    # -- models ------------------------------------------------------------------------------

    def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self._backend.model_id, created=0, owned_by=OWNED_BY)])

    # -- validation --------------------------------------------------------------------------

    def _max_tokens(self, body: ChatCompletionRequest) -> int:
        limit = self._settings.max_completion_tokens
        if body.max_completion_tokens is not None:
            requested, param = body.max_completion_tokens, "max_completion_tokens"
        elif body.max_tokens is not None:
            requested, param = body.max_tokens, "max_tokens"
        else:
            return limit
        if requested > limit:
            raise InvalidRequestError(
                f"{param} must be at most {limit} (got {requested})", param=param, code="invalid_value"
            )
        return requested

    def prepare(self, principal: Principal, body: ChatCompletionRequest) -> PreparedCompletion:
        """Validate ``body`` against the gateway's limits; raises before anything is generated."""
        if body.model != self._backend.model_id:
            raise NotFoundError(f"The model '{body.model}' does not exist", param="model", code="model_not_found")
        max_tokens = self._max_tokens(body)
        turns = tuple(ChatTurn(message.role, message.text()) for message in body.messages)
        prompt_chars = sum(len(turn.content) for turn in turns)
        if prompt_chars > self._settings.max_prompt_chars:
            raise InvalidRequestError(
                f"The messages total {prompt_chars} characters; the limit is {self._settings.max_prompt_chars}",
                param="messages",
                code="context_length_exceeded",
            )
        if not self._backend.ready:
            raise ServiceUnavailableError("The model is still loading; retry shortly")
        handle = self._keyring.active()
        params = handle.key.params
        bits = principal.message_id_for(params.bits, params.block_bits)
        if bits is None:  # every user gets one when a version of a new length is registered or activated
            raise ServiceUnavailableError(
                f"Your account has no {params.bits}-bit message ID for the active watermark key version "
                f"'{handle.name}' yet; retry shortly",
                code="message_id_missing",
            )
        message = Message.from_bits(bits, params)
        request = GenerationRequest(
            messages=turns,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            n=body.n or 1,
            stop=body.stop_strings(),
            seed=body.seed,
        )
        return PreparedCompletion(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self._backend.model_id,
            request=request,
            stamp=WatermarkStamp(handle.key, message, handle.name),
            key_version_id=handle.id,
            principal=principal,
        )

    # -- recording ---------------------------------------------------------------------------

    async def _record(
        self,
        prepared: PreparedCompletion,
        prompt_tokens: int,
        choices: list[ChoiceResult],
        *,
        streamed: bool,
        linger_s: float = 0.0,
    ) -> None:
        """Write one generations row per choice (one INSERT, committed before this returns)."""
        retain = self._settings.retain_completions
        created_at = utcnow()
        rows = [
            {
                "request_id": prepared.request_id,
                "choice_index": choice.index,
                "user_id": prepared.principal.user_id,
                "key_version_id": prepared.key_version_id,
                "model": prepared.model,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": choice.completion_tokens,
                "finish_reason": choice.finish_reason or FinishReason.CANCELLED,
                "streamed": streamed,
                "completion_sha256": _sha256(choice.text),
                "completion_text": choice.text if retain else None,
                "created_at": created_at,
            }
            for choice in choices
        ]
        await self._records.write(rows, linger_s=linger_s)
        for row in rows:
            self._metrics.generations.labels(finish_reason=row["finish_reason"]).inc()
        self._metrics.tokens_generated.labels(kind="prompt").inc(prompt_tokens)
        self._metrics.tokens_generated.labels(kind="completion").inc(
            sum(choice.completion_tokens for choice in choices)
        )

    # -- non-streamed ------------------------------------------------------------------------

    async def _record_after_response(
        self,
        prepared: PreparedCompletion,
        prompt_tokens: int,
        choices: list[ChoiceResult],
        *,
        streamed: bool,
        linger_s: float = 0.0,
    ) -> None:
        """Write the rows of a completion whose response has gone out; never raises.

        ``linger_s`` (non-streamed completions: ``record_linger_ms``) delays the first attempt so
        that the write does not compete with the client and the next request, and rows of
        completions finishing meanwhile share its commit. A stream's rows are written at once:
        its response ends only after them.

        A failed write is retried after each of ``RECORD_RETRY_PAUSES_S``. If it still fails the
        failure is counted (``xmark_generation_record_failures_total``) and logged at ERROR with
        what identifies the completion; never its text, its hash or the database's message (which
        may quote the row).
        """
        attempts = 0
        for pause in (*RECORD_RETRY_PAUSES_S, None):
            attempts += 1
            try:
                await self._record(prepared, prompt_tokens, choices, streamed=streamed, linger_s=linger_s)
                return
            except Exception as exc:
                error_type = type(exc).__name__
            linger_s = 0.0  # retries go at once after their pause
            if pause is not None:
                await asyncio.sleep(pause)
        self._metrics.generation_record_failures.inc()
        logger.error(
            "generation record not written",
            extra={
                "request_id": prepared.request_id,
                "user_id": prepared.principal.user_id,
                "key_version_id": prepared.key_version_id,
                "model": prepared.model,
                "streamed": streamed,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": [choice.completion_tokens for choice in choices],
                "finish_reasons": [choice.finish_reason or FinishReason.CANCELLED for choice in choices],
                "attempts": attempts,
                "error_type": error_type,
            },
        )

    async def complete(self, prepared: PreparedCompletion) -> CompletedChat:
        started = time.perf_counter()
        result: GenerationResult = await self._backend.generate(prepared.request, prepared.stamp)
        model_ms = (time.perf_counter() - started) * 1000
        completion = self._completion(prepared, result)
        if self._settings.record_before_response:
            await self._record(prepared, result.prompt_tokens, result.choices, streamed=False)
            return CompletedChat(completion, model_ms)
        after = functools.partial(
            self._record_after_response,
            prepared,
            result.prompt_tokens,
            result.choices,
            streamed=False,
            linger_s=self._settings.record_linger_ms / 1000,
        )
        return CompletedChat(completion, model_ms, after)

    @staticmethod
    def _completion(prepared: PreparedCompletion, result: GenerationResult) -> ChatCompletion:
        completion_tokens = result.completion_tokens
        return ChatCompletion(
            id=prepared.request_id,
            created=prepared.created,
            model=prepared.model,
            choices=[
                Choice(
                    index=choice.index,
                    message=AssistantMessage(content=choice.text),
                    finish_reason=choice.finish_reason,
                )
                for choice in result.choices
            ],
            usage=Usage(
                prompt_tokens=result.prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=result.prompt_tokens + completion_tokens,
            ),
        )

    # -- streamed ----------------------------------------------------------------------------

    async def open_stream(self, prepared: PreparedCompletion) -> GenerationStream:
        """Enqueue the generation; errors (not ready, context too long) surface here, before any byte is sent."""
        return await self._backend.stream(prepared.request, prepared.stamp)

    @staticmethod
    def _chunk(
        prepared: PreparedCompletion, choices: list[ChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=prepared.request_id, created=prepared.created, model=prepared.model, choices=choices, usage=usage
        )

    async def stream_chunks(
        self, prepared: PreparedCompletion, stream: GenerationStream, *, include_usage: bool
    ) -> AsyncGenerator[ChatCompletionChunk | GatewayError | EndOfStream, None]:
        """The chunks of a streamed completion, then ``EndOfStream``; a backend failure midway is
        yielded as the error (the last item) for the client to receive in-band.

        The generation is recorded when the stream ends for any reason (close this generator when
        the client leaves: ``contextlib.aclosing``); the backend is then told to stop and the
        record holds what was sent.
        """
        n = prepared.request.n
        tally = [ChoiceResult(i) for i in range(n)]
        try:
            yield self._chunk(
                prepared, [ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content="")) for i in range(n)]
            )
            try:
                async for delta in stream:
                    choices = []
                    if delta.text:
                        choices.append(ChunkChoice(index=delta.index, delta=ChunkDelta(content=delta.text)))
                    if delta.finish_reason is not None:
                        choices.append(
                            ChunkChoice(index=delta.index, delta=ChunkDelta(), finish_reason=delta.finish_reason)
                        )
                    if choices:
                        yield self._chunk(prepared, choices)
                    choice = tally[delta.index]
                    choice.text += delta.text
                    choice.completion_tokens = delta.completion_tokens
                    choice.finish_reason = delta.finish_reason
            except GatewayError as error:  # the backend failed midway: tell the client in-band
                for choice in tally:
                    choice.finish_reason = choice.finish_reason or FinishReason.ERROR
                yield error
                return
            if include_usage:
                completion_tokens = sum(c.completion_tokens for c in tally)
                usage = Usage(
                    prompt_tokens=stream.prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=stream.prompt_tokens + completion_tokens,
                )
                yield self._chunk(prepared, [], usage)
            yield EndOfStream()
        finally:
            stream.cancel()  # no-op when the generation already finished
            with anyio.CancelScope(shield=True):
                await self._record_after_response(prepared, stream.prompt_tokens, tally, streamed=True)
