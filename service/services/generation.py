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
completion is sent as soon as it exists, a stream as it is generated. The insert skips a
(request id, choice index) already stored, so a record is never written twice; one the database
does not take in time goes to the local spool and is drained into the database when it answers
again (``service.db.spool``). A non-streamed completion's rows first linger ``record_linger_ms``
(group commit). With ``record_before_response`` a completion is sent (a stream: its ``[DONE]``)
only once its rows are durable, in the database or the spool; so is a non-streamed completion
while ``record_backlog_limit`` records are being written (the database has fallen behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from opentelemetry.trace import SpanKind

from service.backends.base import (
    ChatTurn,
    ChoiceDelta,
    ChoiceResult,
    GenerationRequest,
    GenerationResult,
    GenerationStream,
    WatermarkStamp,
)
from service.db.spool import RecordNotDurable, SpooledWriter
from service.errors import (
    DatabaseUnavailableError,
    GatewayError,
    InvalidRequestError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from service.fleet import Fleet, ServedModel
from service.models import utcnow
from service.provenance.sketch import sketch_columns
from service.salts import SaltRotation, seeded_salt
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
    SamplingRequest,
    Usage,
)
from service.schemas.common import EndUserIdentity, Principal
from service.schemas.completions import TEXT_COMPLETION_DEFAULT_MAX_TOKENS, CompletionRequest
from service.services.admission import Admission, Ticket, UserLimits
from service.services.encoder_choice import EncoderRule, choose_encoder
from service.services.request_fields import (
    DEFAULT_HONOURED,
    TEXT_COMPLETION_FIELDS,
    TEXT_COMPLETION_OPTIONS,
    check_logprobs,
    refuse_message_extras,
    refuse_tool_turns,
    refuse_unhonoured,
    sent_fields,
)
from service.telemetry import AttributeValue, Telemetry
from service.vocabulary import FinishReason
from xmark_core import Message

if TYPE_CHECKING:
    from service.backends import Backend
    from service.config import Settings
    from service.end_users.directory import EndUserDirectory
    from service.keyring import Keyring
    from service.metrics import Metrics
    from service.provenance.sketch import Sketcher

OWNED_BY = "xmark-gateway"

logger = logging.getLogger("xmark.generation")


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
    # the model that generates it (its backend and its limits)
    served: ServedModel
    # time.monotonic() by which the request must have finished (request_timeout_s after prepare)
    deadline: float = math.inf


class AdmittedStream:
    """A backend stream the gateway admitted: it enforces the request's deadline and gives the
    admission ticket back (slots freed, token reservation corrected to the tokens used) as soon
    as the stream ends, fails, times out or is cancelled.

    Past the deadline the backend is told to stop and the next read raises ``RequestTimeoutError``
    (504; a stream sends it as its error event); the choices still open are recorded as ``error``:
    the client got an error, not a completion.
    """

    def __init__(self, inner: GenerationStream, ticket: Ticket, deadline: float, timeout_s: float, n: int) -> None:
        self._inner = inner
        self._ticket = ticket
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._tokens = [0] * n
        # one timer for the whole stream (not one per delta): at the deadline it cancels the read
        # in progress, which then raises RequestTimeoutError
        self._timer: asyncio.TimerHandle | None = None
        self._reader: asyncio.Task[object] | None = None
        self._expired = False

    @property
    def prompt_tokens(self) -> int:
        return self._inner.prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        self._inner.prompt_tokens = value

    def __aiter__(self) -> AdmittedStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        if self._timer is None and not self._expired:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, self._deadline - time.monotonic()), self._expire)
        self._reader = asyncio.current_task()
        try:
            if self._expired:
                raise asyncio.CancelledError
            delta = await anext(self._inner)
        except asyncio.CancelledError:
            self._end()
            reader = self._reader
            # cancelled by the deadline alone (not also by someone else): the request timed out
            if self._expired and reader is not None and reader.uncancel() == 0:
                self._inner.cancel()
                raise RequestTimeoutError(
                    f"The request did not finish within {self._timeout_s:g} seconds", code="request_timeout"
                ) from None
            raise
        except BaseException:  # the end, a failure
            self._end()
            raise
        finally:
            self._reader = None
        self._tokens[delta.index] = delta.completion_tokens
        return delta

    def _expire(self) -> None:
        self._expired = True
        if self._reader is not None:
            self._reader.cancel()

    def cancel(self) -> None:
        self._inner.cancel()
        self._end()

    def _end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._ticket.release(self.prompt_tokens + sum(self._tokens))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _operation(prepared: PreparedCompletion) -> str:
    """The GenAI operation name: ``chat`` or ``text_completion`` (``/v1/completions``)."""
    return "chat" if prepared.request.prompt is None else "text_completion"


def _genai_response(
    prepared: PreparedCompletion, prompt_tokens: int, choices: list[ChoiceResult]
) -> dict[str, AttributeValue]:
    """The GenAI semantic conventions' response attributes: finish reasons and token usage."""
    return {
        "gen_ai.response.id": prepared.request_id,
        "gen_ai.response.model": prepared.model,
        "gen_ai.response.finish_reasons": [str(c.finish_reason or FinishReason.CANCELLED) for c in choices],
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": sum(c.completion_tokens for c in choices),
    }


class GenerationService:
    def __init__(
        self,
        records: SpooledWriter,
        settings: Settings,
        backend: Backend | Fleet,
        keyring: Keyring,
        metrics: Metrics,
        admission: Admission | None = None,
        telemetry: Telemetry | None = None,
        sketcher: Sketcher | None = None,
        salt_rotation: SaltRotation | None = None,
        end_users: EndUserDirectory | None = None,
    ) -> None:
        self._telemetry = telemetry if telemetry is not None else Telemetry()
        # where a first sight's end user is settled before its record (None: ids are recorded as given)
        self._end_users = end_users
        # the content sketch logged with each record (service.provenance); None: none is stored
        self._sketcher = sketcher
        self._records = records
        self._settings = settings
        # every served model; a service built around one backend serves that one
        self._fleet = backend if isinstance(backend, Fleet) else Fleet.single(backend)
        self._keyring = keyring
        self._metrics = metrics
        # None: an admission point of this service's own (tests that build the service directly)
        self._admission = admission if admission is not None else Admission(settings, metrics)
        # None: a rotation of this service's own (tests that build the service directly)
        self._salt_rotation = salt_rotation if salt_rotation is not None else SaltRotation()
        self._encoder_rule = EncoderRule(
            min_temperature=settings.watermark_sampling_min_temperature,
            min_top_p=settings.watermark_sampling_min_top_p,
        )

    # -- models ------------------------------------------------------------------------------

    def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=0, owned_by=OWNED_BY) for name in self._fleet.names()])

    def served_model(self, name: str) -> ServedModel:
        """The model ``name`` (a served model's name or alias) is served by; 404 ``model_not_found``."""
        return self._fleet.resolve(name)

    def model_card(self, name: str) -> ModelCard:
        """The model object of ``name``: a model ``list_models`` lists, or a served model's alias (its
        model's object, under the model's own name); 404 ``model_not_found`` otherwise."""
        return ModelCard(id=self._fleet.listed_name(name), created=0, owned_by=OWNED_BY)

    # -- validation --------------------------------------------------------------------------

    def _max_tokens(self, served: ServedModel, body: SamplingRequest, default: int | None = None) -> int:
        limit = served.limits(self._settings).max_completion_tokens
        requested, param = body.requested_max_tokens()
        if requested is None:
            return limit if default is None else min(default, limit)
        if requested > limit:
            raise InvalidRequestError(
                f"{param} must be at most {limit} (got {requested})", param=param, code="invalid_value"
            )
        return requested

    def prepare(self, principal: Principal, body: ChatCompletionRequest) -> PreparedCompletion:
        """Validate ``body`` against the gateway's limits; raises before anything is generated."""
        served, turns, options = self._chat_prompt(body)
        return self._prepared(
            principal,
            served,
            body,
            "chatcmpl",
            messages=turns,
            max_tokens=self._max_tokens(served, body),
            options=options,
        )

    async def count_prompt_tokens(self, body: ChatCompletionRequest) -> int:
        """The prompt tokens of ``body`` as its completion would count them (the served model's chat
        template included, and on a backend that takes tools their definitions): validated as
        ``prepare`` validates, and nothing is admitted, generated or recorded."""
        served, turns, options = self._chat_prompt(body)
        if not served.backend.ready:
            raise ServiceUnavailableError(f"The model '{served.name}' is still loading; retry shortly")
        limit = served.limits(self._settings).max_completion_tokens
        return await served.backend.count_prompt_tokens(GenerationRequest(turns, limit, options=options))

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[ServedModel, tuple[ChatTurn, ...], dict[str, object]]:
        """The model ``body`` names, its turns and the options its backend honours; raises 400 for
        a field that backend does not honour or a prompt over ``max_prompt_chars``."""
        served = self._fleet.resolve(body.model)
        honoured = getattr(served.backend, "honoured_fields", DEFAULT_HONOURED)
        sent = sent_fields(body)
        refuse_unhonoured(sent, honoured, served.limits(self._settings).backend)
        refuse_message_extras(body.messages)
        options = {name: value for name, value in sent.items() if name in honoured - DEFAULT_HONOURED}
        check_logprobs(options, allowed=self._settings.allow_logprobs, max_top=self._settings.max_top_logprobs)
        refuse_tool_turns(body.messages, honoured, served.name)
        turns = tuple(
            ChatTurn(
                # a developer message is a system message by another name
                "system" if message.role == "developer" else message.role,
                message.text(),
                tool_calls=tuple(call.model_dump(mode="json") for call in message.tool_calls or ()),
                tool_call_id=message.tool_call_id,
                null_content=message.content is None,
            )
            for message in body.messages
        )
        self._check_prompt_chars(sum(len(turn.content) for turn in turns), "messages")
        return served, turns, options

    def prepare_text(self, principal: Principal, body: CompletionRequest) -> PreparedCompletion:
        """``prepare`` for ``/v1/completions``: a raw text prompt, continued without the chat template."""
        served = self._fleet.resolve(body.model)
        # the sampling options the backend honours on chat act on the logits alike here
        backend_options = getattr(served.backend, "honoured_fields", DEFAULT_HONOURED) & TEXT_COMPLETION_OPTIONS
        sent = sent_fields(body)
        refuse_unhonoured(sent, TEXT_COMPLETION_FIELDS | backend_options, served.limits(self._settings).backend)
        options = {name: value for name, value in sent.items() if name in backend_options}
        prompt = body.prompt_text()
        self._check_prompt_chars(len(prompt), "prompt")
        # OpenAI's default for this endpoint is 16 tokens
        max_tokens = self._max_tokens(served, body, default=TEXT_COMPLETION_DEFAULT_MAX_TOKENS)
        return self._prepared(principal, served, body, "cmpl", prompt=prompt, max_tokens=max_tokens, options=options)

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        if chars > self._settings.max_prompt_chars:
            raise InvalidRequestError(
                f"The {param} text has {chars} characters; the limit is {self._settings.max_prompt_chars}",
                param=param,
                code="context_length_exceeded",
            )

    def _prepared(
        self,
        principal: Principal,
        served: ServedModel,
        body: SamplingRequest,
        id_prefix: str,
        *,
        max_tokens: int,
        messages: tuple[ChatTurn, ...] = (),
        prompt: str | None = None,
        options: dict[str, object] | None = None,
    ) -> PreparedCompletion:
        if not served.backend.ready:
            raise ServiceUnavailableError(f"The model '{served.name}' is still loading; retry shortly")
        check_options = getattr(served.backend, "check_options", None)
        if options and check_options is not None:  # a bad value is a 400 before admission, never queued
            check_options(options)
        handle = self._keyring.active()
        choice = choose_encoder(handle, served, body, options or {}, rule=self._encoder_rule)
        params = choice.key.params
        bits = principal.message_id_for(params.bits, params.block_bits)
        if bits is None:  # every user gets one when a version of a new length is registered or activated
            raise ServiceUnavailableError(
                f"Your account has no {params.bits}-bit message ID for the active watermark key version "
                f"'{handle.name}' yet; retry shortly",
                code="message_id_missing",
            )
        message = Message.from_bits(bits, params)
        request = GenerationRequest(
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            n=body.n or 1,
            stop=body.stop_strings(),
            seed=body.seed,
            user_id=principal.user_id,
            options=options or {},
            prompt=prompt,
        )
        return PreparedCompletion(
            request_id=f"{id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=served.name,
            request=request,
            stamp=WatermarkStamp(
                choice.key, message, handle.name, self._salt(principal.user_id, request, params.salts), choice.companion
            ),
            key_version_id=handle.id,
            principal=principal,
            served=served,
            deadline=time.monotonic() + self._settings.request_timeout_s,
        )

    def for_end_user(self, prepared: PreparedCompletion, end_user: EndUserIdentity) -> PreparedCompletion:
        """``prepared`` generated for the caller's end user: the stamp embeds the end user's message ID
        of the same length (the account's admission limits and record stay)."""
        params = prepared.stamp.key.params
        bits = end_user.message_id_for(params.bits, params.block_bits)
        if bits is None:  # the end-user directory gives it one of the length it is asked for
            raise ServiceUnavailableError(
                f"The end user has no {params.bits}-bit message ID for the active watermark key version "
                f"'{prepared.stamp.key_version}' yet; retry shortly",
                code="message_id_missing",
            )
        stamp = dataclasses.replace(prepared.stamp, message=Message.from_bits(bits, params))
        principal = prepared.principal.model_copy(update={"end_user": end_user})
        return dataclasses.replace(prepared, stamp=stamp, principal=principal)

    def _salt(self, user_id: int, request: GenerationRequest, salts: int) -> int:
        """The salt of the request's first answer: from its ``seed`` when it has one (the same seed,
        the same answer), else the user's next in rotation (``service.salts``)."""
        if request.seed is not None:
            return seeded_salt(request.seed, salts)
        return self._salt_rotation.take(user_id, request.n, salts)

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
        """Make one generations row per choice durable before this returns: committed in the
        database, or else in the local spool (drained into the database later).

        Raises ``RecordNotDurable`` when neither took them: counted as dropped
        (``xmark_generation_records_dropped_total``) and logged at ERROR with what identifies the
        completion; never its text, its hash or the database's message (which may quote the row).
        """
        retain = self._settings.retain_completions
        created_at = utcnow()
        end_user = prepared.principal.end_user
        end_user_id = None if end_user is None else end_user.id
        if end_user_id is not None and self._end_users is not None and self._end_users.claiming(end_user_id):
            # a first sight's slot, claimed as its record is written: after the linger, off the
            # busy moment after the response, like the write; the end user the claim settles on
            if linger_s > 0:
                await asyncio.sleep(linger_s)
                linger_s = 0.0
            end_user_id = await self._end_users.settled(end_user_id)
        rows = [
            {
                "request_id": prepared.request_id,
                "choice_index": choice.index,
                "user_id": prepared.principal.user_id,
                "end_user_id": end_user_id,
                "key_version_id": prepared.key_version_id,
                "encoder": prepared.stamp.key.params.scheme,
                "model": prepared.model,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": choice.completion_tokens,
                "finish_reason": choice.finish_reason or FinishReason.CANCELLED,
                "streamed": streamed,
                "completion_sha256": _sha256(choice.generated_text()),
                "completion_text": choice.generated_text() if retain else None,
                "created_at": created_at,
                **sketch_columns(self._sketcher, choice.generated_text()),
            }
            for choice in choices
        ]
        try:
            with self._telemetry.span("record", {"xmark.records": len(rows), "xmark.streamed": streamed}):
                await self._records.write(rows, linger_s=linger_s)
        except RecordNotDurable as exc:
            logger.error(
                "generation record not written",
                extra={
                    "request_id": prepared.request_id,
                    "user_id": prepared.principal.user_id,
                    "end_user_id": end_user_id,
                    "key_version_id": prepared.key_version_id,
                    "model": prepared.model,
                    "streamed": streamed,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": [choice.completion_tokens for choice in choices],
                    "finish_reasons": [row["finish_reason"] for row in rows],
                    "error_type": exc.error_type,
                },
            )
            raise
        for row in rows:
            self._metrics.generations.labels(finish_reason=row["finish_reason"], model=prepared.model).inc()
        self._metrics.tokens_generated.labels(kind="prompt", model=prepared.model).inc(prompt_tokens)
        self._metrics.tokens_generated.labels(kind="completion", model=prepared.model).inc(
            sum(choice.completion_tokens for choice in choices)
        )

    async def _record_durably(
        self, prepared: PreparedCompletion, prompt_tokens: int, choices: list[ChoiceResult], *, streamed: bool
    ) -> None:
        """``_record`` for a response that waits for its record (``record_before_response``):
        finished even if the request is cancelled meanwhile; raises ``DatabaseUnavailableError``
        (503) when the rows are not durable, so the completion is not sent."""
        with anyio.CancelScope(shield=True):
            try:
                await self._record(prepared, prompt_tokens, choices, streamed=streamed)
            except RecordNotDurable:
                raise DatabaseUnavailableError("The completion could not be recorded; retry shortly") from None

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
        """Write the rows of a completion whose response has gone out (or is going); never raises.

        ``linger_s`` (non-streamed completions: ``record_linger_ms``) delays the first attempt so
        that the write does not compete with the client and the next request, and rows of
        completions finishing meanwhile share its commit. A stream's rows are written at once:
        its response ends only after them. A record that is not durable is counted and logged
        by ``_record``.
        """
        with contextlib.suppress(RecordNotDurable):  # counted and logged
            await self._record(prepared, prompt_tokens, choices, streamed=streamed, linger_s=linger_s)

    async def _generate(self, prepared: PreparedCompletion) -> GenerationResult:
        """Admit and run a non-streamed generation to its end.

        If it does not end normally, the backend is told to stop and what was generated is
        recorded before the exception propagates: ``cancelled`` when this coroutine was cancelled
        (the client went away), ``error`` for a backend failure or the deadline (the client gets
        a 5xx). Refusals before anything was queued (limits, validation) record nothing.
        """
        stream = await self.open_stream(prepared, streamed=False)
        choices = [ChoiceResult(i) for i in range(prepared.request.n)]
        try:
            async for delta in stream:
                choices[delta.index].add(delta)
        except BaseException as exc:
            stream.cancel()
            reason = FinishReason.CANCELLED if isinstance(exc, asyncio.CancelledError) else FinishReason.ERROR
            for choice in choices:
                choice.finish_reason = choice.finish_reason or reason
            with anyio.CancelScope(shield=True):
                await self._record_after_response(prepared, stream.prompt_tokens, choices, streamed=False)
            raise
        return GenerationResult(prompt_tokens=stream.prompt_tokens, choices=choices)

    def _model_span_name(self, prepared: PreparedCompletion) -> str:
        return f"{_operation(prepared)} {prepared.model}"

    async def complete(self, prepared: PreparedCompletion) -> CompletedChat:
        started = time.perf_counter()
        with self._telemetry.span(
            self._model_span_name(prepared), self._genai_request(prepared), kind=SpanKind.CLIENT
        ) as span:
            result = await self._generate(prepared)
            span.set_attributes(_genai_response(prepared, result.prompt_tokens, result.choices))
        model_ms = (time.perf_counter() - started) * 1000
        completion = self._completion(prepared, result)
        if self._settings.record_before_response or self._records.in_flight >= self._settings.record_backlog_limit:
            # asked for, or the writes after responses have fallen behind: this client waits for its record
            await self._record_durably(prepared, result.prompt_tokens, result.choices, streamed=False)
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
                    message=AssistantMessage(
                        content=choice.text or (None if choice.tool_calls else ""),
                        tool_calls=choice.tool_calls or None,
                    ),
                    finish_reason=choice.finish_reason,
                    logprobs=None if choice.logprobs is None else {"content": choice.logprobs},
                    stop_sequence=choice.stop_sequence,
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

    async def open_stream(self, prepared: PreparedCompletion, *, streamed: bool = True) -> GenerationStream:
        """Admit and enqueue the generation; refusals (prompt too long, a limit reached, not
        ready) surface here, before anything is queued or any byte is sent.

        The prompt is counted in the model's tokens (chat template included) and refused past
        ``max_prompt_tokens``; then the admission point takes a queue slot and the caller's
        allowances, reserving prompt + n x max_tokens tokens (``services.admission``).
        """
        request = prepared.request if streamed else dataclasses.replace(prepared.request, streamed=False)
        backend = prepared.served.backend
        limit = prepared.served.limits(self._settings).max_prompt_tokens
        # a cheap upper bound is reserved where it cannot change the outcome; counted exactly where
        # it meets the prompt limit or the caller's tokens per minute (the account's or its end user's)
        prompt_tokens = await backend.prompt_token_bound(request)
        per_minute = UserLimits.of(prepared.principal, self._settings).tightest_tokens_per_minute
        if prompt_tokens > limit or (per_minute and prompt_tokens + request.n * request.max_tokens > per_minute):
            prompt_tokens = await backend.count_prompt_tokens(request)
        if prompt_tokens > limit:
            raise InvalidRequestError(
                f"The prompt has {prompt_tokens} tokens; the limit is {limit}",
                param="messages",
                code="context_length_exceeded",
            )
        with self._telemetry.span("queue", {"xmark.reserved_prompt_tokens": prompt_tokens}):
            ticket = await self._admission.admit(
                prepared.principal,
                prompt_tokens + request.n * request.max_tokens,
                queue=prepared.served.name,
                max_queued=prepared.served.limits(self._settings).max_queued_requests,
            )
        timeout_s = self._settings.request_timeout_s
        try:
            async with asyncio.timeout(max(0.0, prepared.deadline - time.monotonic())) as deadline:
                stream = await backend.stream(request, prepared.stamp)
        except TimeoutError:
            ticket.release(0)
            if not deadline.expired():
                raise
            raise RequestTimeoutError(f"The request did not finish within {timeout_s:g} seconds") from None
        except BaseException:
            ticket.release(0)  # nothing was generated: the tokens are not charged
            raise
        return AdmittedStream(stream, ticket, prepared.deadline, timeout_s, request.n)

    def _genai_request(self, prepared: PreparedCompletion) -> dict[str, AttributeValue]:
        """The GenAI semantic conventions' request attributes: never the prompt or the output."""
        request = prepared.request
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": _operation(prepared),
            "gen_ai.provider.name": f"xmark-gateway.{prepared.served.limits(self._settings).backend}",
            "gen_ai.request.model": prepared.model,
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": request.temperature,
            "gen_ai.request.top_p": request.top_p,
            "gen_ai.request.choice.count": request.n,
            "enduser.id": str(prepared.principal.user_id),
            "xmark.key_version": prepared.stamp.key_version,
        }
        if request.seed is not None:
            attributes["gen_ai.request.seed"] = request.seed
        return attributes

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

        Each chunk holds one entry per choice index, as OpenAI's do: a choice's last text and
        its finish reason travel in the same entry (a finish reason alone: an empty delta).

        The generation is recorded when the stream ends for any reason (close this generator when
        the client leaves: ``contextlib.aclosing``); the backend is then told to stop and the
        record holds what was sent. With ``record_before_response`` the rows of a stream that
        ran to its end (or failed) are durable before ``EndOfStream`` (the client's ``[DONE]``)
        or the error is yielded; rows that cannot be made durable end the stream with a
        ``database_unavailable`` error instead of ``[DONE]``.
        """
        n = prepared.request.n
        tally = [ChoiceResult(i) for i in range(n)]
        recorded = False
        # not the current span: a generator's context may not be where it is closed
        span = self._telemetry.tracer.start_span(
            self._model_span_name(prepared), kind=SpanKind.CLIENT, attributes=self._genai_request(prepared)
        )
        try:
            yield self._chunk(
                prepared, [ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content="")) for i in range(n)]
            )
            try:
                async for delta in stream:
                    if delta.text or delta.tool_calls or delta.logprobs or delta.finish_reason is not None:
                        entry = ChunkChoice(
                            index=delta.index,
                            delta=ChunkDelta(content=delta.text or None, tool_calls=list(delta.tool_calls) or None),
                            finish_reason=delta.finish_reason,
                            logprobs={"content": list(delta.logprobs)} if delta.logprobs else None,
                            stop_sequence=delta.stop_sequence,
                        )
                        yield self._chunk(prepared, [entry])
                    tally[delta.index].add(delta)
            except GatewayError as error:  # the backend failed midway: tell the client in-band
                for choice in tally:
                    choice.finish_reason = choice.finish_reason or FinishReason.ERROR
                told: GatewayError = error
                if self._settings.record_before_response:
                    recorded = True
                    try:
                        await self._record_durably(prepared, stream.prompt_tokens, tally, streamed=True)
                    except DatabaseUnavailableError as unrecorded:
                        told = unrecorded
                yield told
                return
            if include_usage:
                completion_tokens = sum(c.completion_tokens for c in tally)
                usage = Usage(
                    prompt_tokens=stream.prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=stream.prompt_tokens + completion_tokens,
                )
                yield self._chunk(prepared, [], usage)
            if self._settings.record_before_response:
                recorded = True
                try:
                    await self._record_durably(prepared, stream.prompt_tokens, tally, streamed=True)
                except DatabaseUnavailableError as unrecorded:
                    yield unrecorded
                    return
            yield EndOfStream()
        finally:
            stream.cancel()  # no-op when the generation already finished
            span.set_attributes(_genai_response(prepared, stream.prompt_tokens, tally))
            span.end()
            if not recorded:
                with anyio.CancelScope(shield=True):
                    await self._record_after_response(prepared, stream.prompt_tokens, tally, streamed=True)
