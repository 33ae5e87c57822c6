"""Tracing: check the request, analyse the text (``trace_analysis``), record the trace, count it.

Also the start-up simulation of the null distributions the analysis's test needs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession

from service.db import RowWriter
from service.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from service.fleet import Fleet, ServedModel, models_by_tokenizer
from service.models import utcnow
from service.provenance.retrieval import Retrieved
from service.repositories.provenance import PlannerStatistics, ProvenanceRepository
from service.schemas.common import Principal
from service.schemas.trace import (
    TraceReport,
    TraceRequest,
)
from service.services.provenance import ProvenanceSearch
from service.services.registry_cache import RegistryCache
from service.services.report_records import SignedReportInput, build_signed_report
from service.services.reports import ReportSigner
from service.services.trace_analysis import LengthGroup, TraceOutcome, group_by_length, tokenize
from service.services.trace_fanout import (
    FanoutOutcome,
    ReadingPlan,
    TextReading,
    TraceFanout,
    decoders_for,
    plan_for,
)
from service.vocabulary import TraceDecoder, TraceVerdict
from xmark_core import ModelScores, warm_null_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from service.backends import Backend
    from service.config import Settings
    from service.keyring import Keyring
    from service.metrics import Metrics
    from service.provenance.sketch import Sketcher

logger = logging.getLogger("xmark.trace")

# What runs on the event loop must be short, or every stream this process serves stalls. The
# analysis's cost grows with the text's tokens, not its characters (8,000 CJK characters are about
# 21,000 tokens: ~0.75 s of analysis), so texts of more tokens than this are analysed on a worker
# thread. Below it the analysis takes a few milliseconds once the rows' null distributions are
# prepared (``prepare_null_distributions``), and short traces do not queue behind long ones for
# the worker threads.
INLINE_ANALYSIS_TOKENS = 256
# Tokenizing is fast (a fast tokenizer reads about a million characters a second), but longer
# texts than this are tokenized on a worker thread too.
INLINE_TOKENIZE_CHARS = 4_000


async def prepare_null_distributions(keyring: Keyring, max_row_tokens: int) -> None:
    """Simulate the per-row null distributions that /trace's test needs, for rows of 1 to
    ``max_row_tokens`` tokens and the parameters of every usable key version.

    Each row size is simulated once per process and cached; without
    this, the first traces after start-up pay for it inline. Runs on a worker thread, one row
    size at a time, so it can be cancelled between sizes and the event loop keeps serving.
    """
    started = time.perf_counter()
    done: list[object] = []
    try:
        for handle in keyring.readings():
            params = handle.key.params
            if params in done:
                continue
            done.append(params)
            for n in range(1, max_row_tokens + 1):
                await asyncio.to_thread(warm_null_cache, params, n, min_row_tokens=n)
    except Exception as exc:  # traces still work: they simulate what they need on first use
        logger.warning("preparing trace null distributions failed", extra={"error_type": type(exc).__name__})
        return
    seconds = round(time.perf_counter() - started, 1)
    logger.info(
        "trace null distributions ready",
        extra={"row_tokens": max_row_tokens, "parameter_sets": len(done), "seconds": seconds},
    )


@dataclass(frozen=True)
class _ModelsReading:
    """The text in the tokens of one tokenizer, and the served models that share it."""

    models: tuple[ServedModel, ...]
    tokenizer: PreTrainedTokenizerBase
    ids: list[int]


class TracingService:
    def __init__(
        self,
        session: AsyncSession,
        records: RowWriter,
        settings: Settings,
        backend: Backend | Fleet,
        keyring: Keyring,
        metrics: Metrics,
        registry: RegistryCache,
        signer: ReportSigner,
        sketcher: Sketcher | None = None,
        planner: PlannerStatistics | None = None,
    ) -> None:
        self._signer = signer
        self._provenance = ProvenanceSearch(ProvenanceRepository(session, planner), sketcher, settings)
        self._session = session
        self._records = records
        self._settings = settings
        # every served model; a service built around one backend traces for that one
        self._fleet = backend if isinstance(backend, Fleet) else Fleet.single(backend)
        self._keyring = keyring
        self._metrics = metrics
        self._registry = registry

    async def trace(self, principal: Principal, request: TraceRequest) -> TraceReport:
        settings = self._settings
        for name in request.model_extra or {}:
            raise InvalidRequestError(
                f"Unknown parameter '{name}'; /trace reads text, model, decoder, include_tokens and identity_level",
                param=name,
                code="unsupported_parameter",
            )
        identity_level = self._identity_level(request)
        if len(request.text) > settings.max_trace_chars:
            raise PayloadTooLargeError(f"text is longer than {settings.max_trace_chars} characters", param="text")
        models = list(self._fleet) if request.model is None else [self._fleet.resolve(request.model)]
        by_tokenizer = models_by_tokenizer(models)
        if not by_tokenizer:
            raise ServiceUnavailableError("The tokenizer is still loading; retry shortly")
        versions = self._keyring.readings()  # one per encoder of every usable key version
        if not versions:
            raise ServiceUnavailableError("No usable watermark key version is configured")
        # each message length is read against the registry of that length
        groups = [
            LengthGroup(group, await self._registry.snapshot(group[0].key.params, self._session))
            for group in group_by_length(versions)
        ]
        readings = []
        for sharing, tokenizer in by_tokenizer:  # models sharing a tokenizer tokenize once
            tokenizing = functools.partial(tokenize, tokenizer, request.text)
            if len(request.text) <= INLINE_TOKENIZE_CHARS:
                ids = tokenizing()
            else:
                ids = await asyncio.to_thread(tokenizing)
            readings.append(_ModelsReading(sharing, tokenizer, ids))
        # the second witness: the logged completions the text resembles (content only, no key)
        outcome = await self._provenance.witness(
            request.text,
            functools.partial(self._analyze, request, readings, groups, identity_level=identity_level),
            inline=len(request.text) <= INLINE_TOKENIZE_CHARS,
        )
        report = outcome.report
        verdict = TraceVerdict.WATERMARKED if report.watermarked else TraceVerdict.NOT_WATERMARKED
        handle = next((v for v in versions if v.id == outcome.key_version_id and v.encoder == report.encoder), None)
        signed = build_signed_report(
            self._signer,
            SignedReportInput(
                created_at=utcnow(),
                requester_id=principal.user_id,
                text=request.text,
                report=report,
                verdict=verdict,
                handle=handle,
                requested_decoder=request.decoder,
                alpha=settings.trace_alpha,
                top_k=settings.trace_top_k if report.decoder == TraceDecoder.LIKELIHOOD else None,
            ),
        )
        row = {
            "requester_id": principal.user_id,
            "verdict": verdict,
            "p_value": report.p_value,
            "statistic": report.statistic,
            "scored_tokens": report.scored_tokens,
            "key_version_id": outcome.key_version_id,
            # the account, and its end user when the text carries an end user's message ID
            "attributed_user_id": None if report.attribution is None else report.attribution.user_id,
            "attributed_end_user_id": None
            if report.attribution is None or report.attribution.end_user is None
            else report.attribution.end_user.id,
            "decoder": report.decoder,
            "created_at": signed.created_at,
            **signed.columns,
        }
        report = report.model_copy(update={"report_id": signed.report_id})
        # committed before the report is sent; concurrent traces share the round trip (RowWriter)
        await self._records.write([row])
        self._metrics.trace_verdicts.labels(
            verdict=verdict, attributed="yes" if outcome.attributed_user_id is not None else "no"
        ).inc()
        self._metrics.trace_decoders.labels(decoder=report.decoder).inc()
        return report

    def _identity_level(self, request: TraceRequest) -> float | None:
        """The identity test's level for this trace: the request's, the gateway's
        (``XMARK_TRACE_IDENTITY_LEVEL``), or the stricter of the two; None when neither asks.

        A request may make the gateway's level stricter, never looser, and cannot drop it. The
        test needs the likelihood decoder, so ``decoder: counting`` is refused while one is set.
        """
        gateway = self._settings.trace_identity_level
        asked = request.identity_level
        if asked is not None and gateway is not None and asked > gateway:
            raise InvalidRequestError(
                f"'identity_level' may only be stricter than this gateway's {gateway:g} (got {asked:g})",
                param="identity_level",
                code="invalid_value",
            )
        level = asked if asked is not None else gateway
        if level is not None and request.decoder == TraceDecoder.COUNTING:
            source = "the request's 'identity_level'" if asked is not None else "this gateway's identity level"
            raise InvalidRequestError(
                f"decoder 'counting' cannot honour {source}: the identity test needs the likelihood "
                "decoder (use decoder 'auto' or 'likelihood')",
                param="identity_level" if asked is not None else "decoder",
                code="unsupported_parameter" if asked is not None else "invalid_value",
            )
        return level

    async def _analyze(
        self,
        request: TraceRequest,
        readings: Sequence[_ModelsReading],
        groups: Sequence[LengthGroup],
        retrieved: Retrieved,
        *,
        identity_level: float | None = None,
    ) -> FanoutOutcome:
        """The fan-out's plan for this request, run (``trace_fanout``): counting, likelihood, or
        counting then likelihood (``auto``), over the registry and then the users the generation
        log's leads point to, every message length's key versions, every served model's reading
        (counting once per tokenizer, likelihood with each model's scorer), corrected for all of them.

        The counting decoder runs inline for texts short in tokens. The likelihood decoder's
        forward pass runs on the backend (the local model's thread, or a worker), and its analysis
        (~0.15 ms a token) always on a worker thread: it follows a forward pass that costs far
        more than the hand-over.

        With an ``identity_level`` only the likelihood decoder names (after its identity test):
        ``auto`` always goes on to it, and a text it cannot read is refused rather than left to
        counting's name.
        """
        settings = self._settings
        limit = settings.trace_likelihood_max_tokens
        must_score = request.decoder == TraceDecoder.LIKELIHOOD or identity_level is not None
        plans: list[ReadingPlan] = []
        for reading in readings:
            ids = reading.ids
            requested = request.decoder
            if len(ids) < 3:
                requested = TraceDecoder.COUNTING
            elif requested == TraceDecoder.LIKELIHOOD or (identity_level is not None and len(ids) > limit):
                if len(ids) > limit:
                    raise InvalidRequestError(
                        f"The text has {len(ids)} tokens; the likelihood decoder reads at most {limit} "
                        + (
                            "(use decoder counting or auto)"
                            if identity_level is None
                            else "(the identity test needs it)"
                        ),
                        param="decoder",
                        code="text_too_long_for_decoder",
                    )
                requested = TraceDecoder.LIKELIHOOD
            # auto escalates to the likelihood decoder only where a scorer can read the text; with
            # an identity level it always does (its scoring errors are the request's)
            scorers = tuple(
                m.name for m in reading.models if identity_level is not None or (len(ids) <= limit and m.backend.ready)
            )
            decoders = decoders_for(requested, scorer_available=bool(scorers))
            if TraceDecoder.LIKELIHOOD in decoders and not scorers:
                scorers = tuple(m.name for m in reading.models)  # asked for: its errors are the request's
            if TraceDecoder.LIKELIHOOD not in decoders:
                scorers = ()
            plans.append(ReadingPlan(tuple(m.name for m in reading.models), decoders, scorers))
        used = tuple(d for d in (TraceDecoder.COUNTING, TraceDecoder.LIKELIHOOD) if any(d in p.decoders for p in plans))
        plan = plan_for(groups, retrieved, used, tuple(plans))
        fanout = TraceFanout(
            plan,
            [
                TextReading(
                    reading.ids,
                    reading.tokenizer,
                    alpha=settings.trace_alpha,
                    temperature=settings.trace_temperature,
                    edit_rate=settings.trace_edit_rate,
                    include_tokens=request.include_tokens,
                    identity_level=identity_level,
                )
                for reading in readings
            ],
        )

        async def score(model: ServedModel, ids: list[int]) -> ModelScores | None:
            if must_score:
                return await model.backend.score(ids, settings.trace_top_k)
            try:
                return await model.backend.score(ids, settings.trace_top_k)
            except (
                ServiceUnavailableError,
                UpstreamUnavailableError,
                UpstreamTimeoutError,
                InvalidRequestError,
            ) as exc:
                # no model at hand, or one that cannot read this text (e.g. a worker's shorter context)
                logger.warning(
                    "trace scoring unavailable; counting decided",
                    extra={"error_type": type(exc).__name__, "model": model.name},
                )
                return None

        sources = {
            model.name: functools.partial(score, model, reading.ids) for reading in readings for model in reading.models
        }
        inline = max(len(reading.ids) for reading in readings) <= INLINE_ANALYSIS_TOKENS

        async def run(work: Callable[[], TraceOutcome]) -> TraceOutcome:  # long texts off the event loop
            return work() if inline else await asyncio.to_thread(work)

        return await fanout.run(sources, run_counting=run)
