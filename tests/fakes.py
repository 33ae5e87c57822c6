"""A model backend without a model, for the tests that never generate or trace.

``FakeBackend`` implements ``service.backends.base.Backend``: it is ready as soon as it has
started, and "generates" deterministic words (one word is one token) from the request, the
caller's watermark message and the choice index. It honours ``max_tokens`` (finish reason
``length``), ``n``, ``stop`` strings (cut before the first one, finish reason ``stop``), ends a
choice on its own after a natural length (``stop``, like an end-of-sequence token) and finishes
the choices still open as ``cancelled`` when the stream is cancelled. It has no tokenizer, so
``/trace`` answers 503 (as while a real model loads): tests that trace need the real model.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from service.backends.base import (
    BackendError,
    ChoiceDelta,
    GenerationRequest,
    GenerationResult,
    WatermarkStamp,
    collect,
)
from service.errors import InvalidRequestError, ServiceUnavailableError
from service.services.request_fields import DEFAULT_HONOURED
from service.vocabulary import FinishReason
from xmark_core import ModelScores
from xmark_core.params import SCHEMES

# the fake's vocabulary: its "tokens" are these words
VOCABULARY = (
    "the quick brown fox jumps over a lazy dog while seven red kites drift above quiet green hills "
    "and every river finds its way down to the sea"
)
WORDS = tuple(VOCABULARY.split())
CONTEXT_LENGTH = 2048
TEMPLATE_TOKENS = 5  # what a chat template adds around each turn, roughly


def prompt_tokens(request: GenerationRequest) -> int:
    """The prompt's length in the fake's tokens: its words plus a few per turn."""
    return sum(len(turn.content.split()) + TEMPLATE_TOKENS for turn in request.messages)


@dataclass(frozen=True)
class PlannedChoice:
    """What one choice will produce: its tokens (words with their spacing) and how it ends."""

    tokens: tuple[str, ...]
    finish_reason: FinishReason
    stop_sequence: str | None = None  # the stop string that cut it, if one did


def plan_choice(request: GenerationRequest, stamp: WatermarkStamp | None, index: int) -> PlannedChoice:
    """The deterministic completion of choice ``index``: same request, message and index, same text."""
    material = repr(
        (
            [(turn.role, turn.content) for turn in request.messages],
            request.seed,
            request.temperature,
            stamp.message.bits if stamp is not None else None,
            index,
        )
    )
    rng = random.Random(hashlib.sha256(material.encode()).digest())
    natural = rng.randint(12, 40)  # where the "model" would emit its end-of-sequence token
    count = min(natural, request.max_tokens)
    words = [rng.choice(WORDS) for _ in range(count)]
    tokens = [word if i == 0 else " " + word for i, word in enumerate(words)]
    finish = FinishReason.LENGTH if count == request.max_tokens else FinishReason.STOP
    text = "".join(tokens)
    cuts = [(position, stop) for stop in request.stop if (position := text.find(stop)) >= 0]
    if cuts:  # the tokens that start before the first stop string, the last one cut at it
        cut, stop = min(cuts, key=lambda item: item[0])
        starts = list(itertools.accumulate((len(token) for token in tokens), initial=0))[:-1]
        tokens = [token[: cut - start] for token, start in zip(tokens, starts, strict=True) if start < cut] or [""]
        return PlannedChoice(tuple(tokens), FinishReason.STOP, stop)
    return PlannedChoice(tuple(tokens), finish)


class FakeStream:
    """The deltas of one fake generation: the choices take turns, one token at a time.

    ``token_delay_s`` paces the tokens like a slow model; ``fail_after`` (a number of deltas)
    makes the "model" fail there, as a backend whose generation raises.
    """

    def __init__(
        self,
        request: GenerationRequest,
        stamp: WatermarkStamp | None,
        *,
        token_delay_s: float = 0.0,
        fail_after: int | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens(request)
        self._plans = [plan_choice(request, stamp, index) for index in range(request.n)]
        self._token_delay_s = token_delay_s
        self._fail_after = fail_after
        self._deltas = self._run()
        self._cancelled = False

    async def _run(self) -> AsyncIterator[ChoiceDelta]:
        produced = [0] * len(self._plans)
        open_choices = set(range(len(self._plans)))
        step = 0
        while open_choices:
            for index in sorted(open_choices):
                await asyncio.sleep(self._token_delay_s)  # a real backend yields between tokens
                if self._fail_after is not None and step * len(self._plans) + index >= self._fail_after:
                    raise BackendError("Generation failed in the model backend")
                if self._cancelled:
                    open_choices.discard(index)
                    yield ChoiceDelta(index, "", produced[index], FinishReason.CANCELLED)
                    continue
                plan = self._plans[index]
                text = ""
                if step < len(plan.tokens):
                    text, produced[index] = plan.tokens[step], step + 1
                last = step >= len(plan.tokens) - 1
                if last:
                    open_choices.discard(index)
                yield ChoiceDelta(
                    index,
                    text,
                    produced[index],
                    plan.finish_reason if last else None,
                    stop_sequence=plan.stop_sequence if last else None,
                )
            step += 1

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        return await self._deltas.__anext__()

    def cancel(self) -> None:
        self._cancelled = True


class FakeBackend:
    """``service.backends.base.Backend`` without a model (see the module docstring)."""

    honoured_fields = DEFAULT_HONOURED
    schemes = frozenset(SCHEMES)
    salts_per_answer = True
    encoders_per_request = True

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.requests: list[tuple[GenerationRequest, WatermarkStamp]] = []  # every request, in order
        self.token_delay_s = 0.0  # FakeStream's options for the streams started from now on
        self.fail_after: int | None = None
        self._started = False
        self._closed = False

    @property
    def ready(self) -> bool:
        return self._started and not self._closed

    @property
    def tokenizer(self) -> Any:
        return None

    async def start(self) -> None:
        self._started = True

    async def wait_ready(self, timeout: float | None = None) -> bool:
        return self.ready

    async def close(self) -> None:
        self._closed = True

    async def stream(self, request: GenerationRequest, stamp: WatermarkStamp) -> FakeStream:
        if not self.ready:
            raise ServiceUnavailableError("The model is still loading; retry shortly")
        if prompt_tokens(request) + request.max_tokens > CONTEXT_LENGTH:
            raise InvalidRequestError(
                f"The prompt ({prompt_tokens(request)} tokens) plus max_tokens ({request.max_tokens}) exceeds "
                f"the model's context length of {CONTEXT_LENGTH} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        self.requests.append((request, stamp))
        return FakeStream(request, stamp, token_delay_s=self.token_delay_s, fail_after=self.fail_after)

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        if not self.ready:
            raise ServiceUnavailableError("The model is still loading; retry shortly")
        return prompt_tokens(request)

    async def prompt_token_bound(self, request: GenerationRequest) -> int:
        return await self.count_prompt_tokens(request)

    async def generate(self, request: GenerationRequest, stamp: WatermarkStamp) -> GenerationResult:
        return await collect(await self.stream(request, stamp), request.n)

    async def score(self, token_ids: Sequence[int], top_k: int) -> ModelScores:
        """No model, no scores: /trace's likelihood decoder is unavailable (and its tokenizer is None)."""
        raise ServiceUnavailableError("The fake backend has no model to score with")
