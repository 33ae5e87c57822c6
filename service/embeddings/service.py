"""An embeddings request's path through the gateway: validate, count, admit, embed, record, respond.

* **Validation** (400 before anything is counted or queued, ``param`` naming the field): fields
  outside OpenAI's embeddings API by name; ``input`` a non-empty text or list of non-empty texts
  (token-id arrays refused by name), at most ``embedding_max_inputs`` of them, each at most
  ``embedding_max_input_chars`` characters and, counted in the model's tokens, at most
  ``embedding_max_input_tokens`` and the model's own context (never cut short); ``dimensions``
  only where the model honours it.
* **Admission** is chat's (``services.admission``): the model's queue (``max_queued_requests``)
  and the caller's limits (parallel requests, requests per minute, tokens per minute, all
  models together). The input tokens are the reservation; it is corrected to the tokens the
  model read when the request ends (nothing, when it failed).
* **Deadline**: ``request_timeout_s``, then 504.
* **Record**: one ``embedding_records`` row, committed before the response (``records``); it is
  what the caller's usage counts. Embeddings carry no watermark and have no generation record.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from opentelemetry.trace import SpanKind

from service.embeddings.base import Embedded
from service.embeddings.records import EmbeddingRecords, EmbeddingUse
from service.embeddings.schemas import EMBEDDING_FIELDS, Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from service.errors import InvalidRequestError, RequestTimeoutError, ServiceUnavailableError
from service.models import utcnow
from service.telemetry import Telemetry

if TYPE_CHECKING:
    from service.config import Settings
    from service.embeddings.models import EmbeddingModel, EmbeddingModels
    from service.fleet import Fleet
    from service.metrics import Metrics
    from service.schemas.common import Principal
    from service.services.admission import Admission

_TEXTS = "input must be a string or a list of strings"


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def input_texts(value: Any, *, max_inputs: int, max_chars: int) -> list[str]:
    """The texts of ``input``, checked against the gateway's limits (400 naming ``input``)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list):
        raise InvalidRequestError(_TEXTS, param="input", code="invalid_type")
    if not texts:
        raise InvalidRequestError("input must hold at least one text", param="input", code="invalid_value")
    if all(_token_id(item) for item in texts) or all(
        isinstance(item, list) and item and all(_token_id(token) for token in item) for item in texts
    ):
        raise InvalidRequestError(
            "input holds token ids; this gateway embeds texts only: send the text itself",
            param="input",
            code="unsupported_parameter",
        )
    if not all(isinstance(item, str) for item in texts):
        raise InvalidRequestError(_TEXTS, param="input", code="invalid_type")
    if len(texts) > max_inputs:
        raise InvalidRequestError(
            f"input holds {len(texts)} texts; the limit is {max_inputs} per request",
            param="input",
            code="invalid_value",
        )
    for index, text in enumerate(texts):
        if not text:
            raise InvalidRequestError(f"input[{index}] is empty", param="input", code="invalid_value")
        if len(text) > max_chars:
            raise InvalidRequestError(
                f"input[{index}] has {len(text)} characters; the limit is {max_chars}",
                param="input",
                code="context_length_exceeded",
            )
    return texts


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One vector (float32 [D]) as the response carries it: numbers, or its little-endian float32
    bytes in base64 (what the openai client decodes with ``np.frombuffer(..., dtype="float32")``)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    values: list[float] = vector.tolist()
    return values


class EmbeddingService:
    def __init__(
        self,
        *,
        models: EmbeddingModels,
        chat: Fleet,
        records: EmbeddingRecords,
        settings: Settings,
        admission: Admission,
        metrics: Metrics,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._models = models
        self._chat = chat
        self._records = records
        self._settings = settings
        self._admission = admission
        self._metrics = metrics
        self._telemetry = telemetry if telemetry is not None else Telemetry()

    async def create(self, principal: Principal, body: EmbeddingRequest) -> EmbeddingList:
        """The embeddings of ``body``'s texts, counted in the caller's usage (module docstring)."""
        for name in body.model_extra or {}:
            raise InvalidRequestError(
                f"Unknown parameter '{name}'; /v1/embeddings reads {', '.join(sorted(EMBEDDING_FIELDS))}",
                param=name,
                code="unsupported_parameter",
            )
        served = self._models.resolve(body.model, self._chat)
        settings = self._settings
        texts = input_texts(
            body.input, max_inputs=settings.embedding_max_inputs, max_chars=settings.embedding_max_input_chars
        )
        backend = served.backend
        if not backend.ready:
            raise ServiceUnavailableError(f"The model '{served.name}' is still loading; retry shortly")
        dimensions = body.dimensions
        if dimensions is not None and backend.dimensions is not None and dimensions != backend.dimensions:
            raise InvalidRequestError(
                f"The model '{served.name}' gives {backend.dimensions}-dimensional embeddings and cannot "
                f"shorten them; leave dimensions out or send {backend.dimensions}",
                param="dimensions",
                code="unsupported_value",
            )
        if dimensions == backend.dimensions:
            dimensions = None  # the model's own length: nothing to ask of it
        counts = await backend.count_tokens(texts)
        self._check_tokens(served, counts)
        started = time.monotonic()
        with self._telemetry.span(
            f"embeddings {served.name}",
            {
                "gen_ai.operation.name": "embeddings",
                "gen_ai.provider.name": f"xmark-gateway.{served.settings.backend}",
                "gen_ai.request.model": served.name,
                "enduser.id": str(principal.user_id),
                "xmark.inputs": len(texts),
            },
            kind=SpanKind.CLIENT,
        ) as span:
            embedded = await self._embed(principal, served, texts, sum(counts), dimensions, started)
            span.set_attributes({"gen_ai.usage.input_tokens": embedded.prompt_tokens})
        self._metrics.tokens_generated.labels(kind="embedding", model=served.name).inc(embedded.prompt_tokens)
        return EmbeddingList(
            data=[
                Embedding(index=index, embedding=encoded(vector, body.encoding_format))
                for index, vector in enumerate(embedded.vectors)
            ],
            model=served.name,
            usage=EmbeddingUsage(prompt_tokens=embedded.prompt_tokens, total_tokens=embedded.prompt_tokens),
        )

    def _check_tokens(self, served: EmbeddingModel, counts: Sequence[int]) -> None:
        """Each text within ``embedding_max_input_tokens`` and the model's own context (400 naming ``input``)."""
        limit = self._settings.embedding_max_input_tokens
        context = served.backend.max_input_tokens
        most = limit if context is None else min(limit, context)
        for index, tokens in enumerate(counts):
            if tokens > most:
                reads = f"the model '{served.name}' reads at most {most}" if most == context else f"the limit is {most}"
                raise InvalidRequestError(
                    f"input[{index}] has {tokens} tokens; {reads}", param="input", code="context_length_exceeded"
                )

    async def _embed(
        self,
        principal: Principal,
        served: EmbeddingModel,
        texts: list[str],
        tokens: int,
        dimensions: int | None,
        started: float,
    ) -> Embedded:
        """Admit, embed within the deadline and record; the admission ticket is given back with
        the tokens used (none when the request failed)."""
        ticket = await self._admission.admit(
            principal, tokens, queue=served.name, max_queued=served.settings.max_queued_requests
        )
        used = 0
        try:
            timeout_s = self._settings.request_timeout_s
            try:
                async with asyncio.timeout(max(0.0, started + timeout_s - time.monotonic())) as deadline:
                    embedded = await served.backend.embed(texts, dimensions=dimensions)
            except TimeoutError:
                if not deadline.expired():
                    raise
                raise RequestTimeoutError(
                    f"The request did not finish within {timeout_s:g} seconds", code="request_timeout"
                ) from None
            if embedded.vectors.shape[0] != len(texts):
                raise ServiceUnavailableError(f"The model '{served.name}' answered for another number of texts")
            prompt_tokens = embedded.prompt_tokens or tokens
            await self._records.write(
                EmbeddingUse(
                    request_id=f"embd-{uuid.uuid4().hex}",
                    user_id=principal.user_id,
                    model=served.name,
                    inputs=len(texts),
                    prompt_tokens=prompt_tokens,
                    created_at=utcnow(),
                )
            )
            used = prompt_tokens
        finally:
            ticket.release(used)
        return Embedded(vectors=embedded.vectors, prompt_tokens=prompt_tokens)
