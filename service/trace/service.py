"""Tracing: :func:`run_trace`, the one entry point of a trace's analysis (the HTTP route, ``xmark
trace`` and every evaluation call it), and the route's service around it: check the request, find
the log's leads (``provenance.search``), run the trace, sign and record the report, count it."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from service.provenance.search import ProvenanceSearch
from service.repositories.unit import Repositories
from service.schemas.common import Principal
from service.services.registry_cache import RegistryCache
from service.services.reports import ReportSigner
from service.trace.analysis import LengthGroup, TraceOutcome, group_by_length, tokenize
from service.trace.fanout import FanoutOutcome, Runner, ScoreSource, TextReading, TraceFanout, on_thread
from service.trace.plan import ReadingPlan, decoders_for, plan_for
from service.trace.policy import TracePolicy
from service.trace.report import SignedReportInput, build_signed_report
from service.trace.schemas import (
    TraceReport,
    TraceRequest,
)
from service.vocabulary import TraceDecoder, TraceVerdict
from xmark_core import ModelScores

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
# prepared (``keyring.prepare_null_distributions``), and short traces do not queue behind long ones for
# the worker threads.
INLINE_ANALYSIS_TOKENS = 256
# Tokenizing is fast (a fast tokenizer reads about a million characters a second), but longer
# texts than this are tokenized on a worker thread too.
INLINE_TOKENIZE_CHARS = 4_000


async def _inline(work: Callable[[], TraceOutcome]) -> TraceOutcome:
    return work()


async def run_trace(
    groups: Sequence[LengthGroup],
    retrieved: Retrieved | Sequence[int],
    readings: TextReading | Sequence[TextReading],
    scores: ScoreSource | Mapping[str, ScoreSource],
    policy: TracePolicy,
    *,
    decoders: tuple[TraceDecoder, ...] | None = None,
    plans: tuple[ReadingPlan, ...] | None = None,
    run_counting: Runner[TraceOutcome] = _inline,
    run_likelihood: Runner[TraceOutcome] = on_thread,
) -> FanoutOutcome:
    """A trace's analysis: the fan-out's plan (``trace.plan``) over the registry's ``groups`` and
    the ``retrieved`` leads, run on the text's ``readings`` under ``policy`` (``trace.fanout``).

    ``plans``: one per reading (its models, decoders and scorers; the route's and the CLI's); or
    ``decoders`` for one reading by one model (``scores`` its scores; the evaluations'). ``run_*``
    run the analyses (inline by default, the likelihood decoder's on a worker thread).
    """
    if (plans is None) == (decoders is None):
        raise ValueError("give either plans (one per reading) or decoders (one reading)")
    used = decoders or tuple(
        d for d in (TraceDecoder.COUNTING, TraceDecoder.LIKELIHOOD) if any(d in p.decoders for p in plans or ())
    )
    plan = plan_for(groups, retrieved, used, plans, policy=policy)
    fanout = TraceFanout(plan, readings, policy)
    return await fanout.run(scores, run_counting=run_counting, run_likelihood=run_likelihood)


def run_trace_now(
    groups: Sequence[LengthGroup],
    retrieved: Retrieved | Sequence[int],
    reading: TextReading,
    scores: ModelScores | None,
    policy: TracePolicy,
    *,
    decoders: tuple[TraceDecoder, ...],
) -> FanoutOutcome:
    """:func:`run_trace` of one reading with its scores at hand, every analysis inline (offline
    evaluations; not from within a running event loop)."""

    async def given() -> ModelScores | None:
        return scores

    return asyncio.run(
        run_trace(
            groups, retrieved, reading, given, policy, decoders=decoders, run_counting=_inline, run_likelihood=_inline
        )
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
        repos: Repositories,
        records: RowWriter,
        settings: Settings,
        backend: Backend | Fleet,
        keyring: Keyring,
        metrics: Metrics,
        registry: RegistryCache,
        signer: ReportSigner,
        sketcher: Sketcher | None = None,
    ) -> None:
        self._signer = signer
        self._policy = TracePolicy.from_settings(settings)
        self._provenance = ProvenanceSearch(repos.provenance, sketcher, self._policy)
        self._session = repos.session
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
                alpha=self._policy.alpha,
                top_k=self._policy.top_k if report.decoder == TraceDecoder.LIKELIHOOD else None,
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
        """The fan-out's plan for this request, run (``trace.fanout``): counting, likelihood, or
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
        policy = self._policy.with_identity_level(identity_level)
        limit = policy.likelihood_max_tokens
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
        texts = [TextReading(reading.ids, reading.tokenizer, request.include_tokens) for reading in readings]

        async def score(model: ServedModel, ids: list[int]) -> ModelScores | None:
            if must_score:
                return await model.backend.score(ids, policy.top_k)
            try:
                return await model.backend.score(ids, policy.top_k)
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

        return await run_trace(groups, retrieved, texts, sources, policy, plans=tuple(plans), run_counting=run)
