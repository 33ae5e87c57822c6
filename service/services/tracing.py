"""Tracing: decode the watermark of a suspect text, test it, and name the user it encodes.

The text is tokenized with the served model's tokenizer (no chat template; special tokens are
skipped by the decoder). Every usable key version is tried and the one that explains the text
best (smallest p-value) is reported. Attribution scores the decoded counts against every
registered message ID, deleted users' tombstones included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession

from service.db import RowWriter
from service.errors import NotFoundError, PayloadTooLargeError, ServiceUnavailableError
from service.keyring import KeyVersionHandle
from service.models import utcnow
from service.schemas.common import Principal
from service.schemas.trace import (
    AttributionReport,
    BlockReport,
    CandidateReport,
    TokenReport,
    TraceReport,
    TraceRequest,
)
from service.services.registry_cache import RegistryCache, RegistrySnapshot
from service.vocabulary import TraceVerdict
from xmark_core import Attribution, DecodeResult, Detection, attribute, decode, detect, warm_null_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from service.backends import Backend
    from service.config import Settings
    from service.keyring import Keyring
    from service.metrics import Metrics

logger = logging.getLogger("xmark.trace")

TOP_CANDIDATES = 5
# Texts longer than this are analysed on a worker thread so the event loop stays responsive.
INLINE_ANALYSIS_CHARS = 8_000


@dataclass(frozen=True)
class TraceOutcome:
    report: TraceReport
    key_version_id: int | None
    attributed_user_id: int | None


@dataclass(frozen=True)
class _Reading:
    handle: KeyVersionHandle
    result: DecodeResult
    detection: Detection
    attribution: Attribution

    @property
    def strength(self) -> float:
        return min(self.detection.p_value, self.attribution.p_value)


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The text's token ids, no special tokens added (the same ids as ``tokenizer.encode``).

    Fast tokenizers are called through their Rust backend directly: the Python wrapper around it
    costs about a quarter of a 300-token text's tokenization and adds nothing here. The backend
    would apply a truncation or padding configured in the checkpoint's tokenizer file, which the
    wrapper switches off, so such a tokenizer goes through the wrapper.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _empty_report(bits: int, block_bits: int) -> TraceReport:
    blocks = [
        BlockReport(index=i, counts=[0] * (1 << block_bits), value=None, margin=0, confidence=0.0, erased=True)
        for i in range(bits // block_bits)
    ]
    return TraceReport(
        watermarked=False,
        p_value=1.0,
        statistic=0.0,
        scored_tokens=0,
        key_version=None,
        decoded_message="?" * bits,
        blocks=blocks,
        attribution=None,
        candidates=[],
        tokens=None,
    )


def _token_reports(tokenizer: PreTrainedTokenizerBase, ids: list[int], result: DecodeResult) -> list[TokenReport]:
    assert result.token_blocks is not None and result.token_shards is not None
    pieces = [tokenizer.decode([token], clean_up_tokenization_spaces=False) for token in ids]
    reports = []
    for position, token in enumerate(ids):
        block = int(result.token_blocks[position])
        reports.append(
            TokenReport(
                text=pieces[position],
                id=token,
                block=None if block < 0 else block,
                shards=None if block < 0 else [int(s) for s in result.token_shards[position]],
            )
        )
    return reports


def analyze_text(
    text: str,
    tokenizer: PreTrainedTokenizerBase,
    versions: Sequence[KeyVersionHandle],
    snapshot: RegistrySnapshot,
    *,
    alpha: float,
    include_tokens: bool = False,
) -> TraceOutcome:
    """The full trace report of ``text`` (pure computation: no I/O)."""
    params = versions[0].key.params
    ids = tokenize(tokenizer, text)
    if len(ids) < 3:  # the first two tokens are context only: nothing to score
        report = _empty_report(params.bits, params.block_bits)
        if include_tokens:
            report.tokens = [
                TokenReport(
                    text=tokenizer.decode([t], clean_up_tokenization_spaces=False), id=t, block=None, shards=None
                )
                for t in ids
            ]
        return TraceOutcome(report, None, None)
    special = tokenizer.all_special_ids
    # Trying several key versions is several tests: Bonferroni-correct the level and the p-values.
    tries = len(versions)
    alpha_each = alpha / tries
    best: _Reading | None = None
    for handle in versions:
        result = decode(ids, handle.key, skip_ids=special, per_token=include_tokens)
        reading = _Reading(
            handle,
            result,
            detect(result, alpha=alpha_each, sigma_test=False),  # the report has no sigma p-value
            attribute(result, snapshot.candidates, top=TOP_CANDIDATES, alpha=alpha_each),
        )
        if best is None or reading.strength < best.strength:
            best = reading
    assert best is not None
    result, detection, attribution = best.result, best.detection, best.attribution
    users = snapshot.users

    def name_of(user_id: object) -> str:
        user = users.get(int(user_id))  # type: ignore[call-overload]
        return user.name if user is not None else ""

    attributed = attribution.best
    report = TraceReport(
        watermarked=detection.is_watermarked,
        p_value=min(1.0, detection.p_value * tries),
        statistic=detection.statistic,
        scored_tokens=result.scored_tokens,
        key_version=best.handle.name,
        decoded_message=result.bits,
        blocks=[
            BlockReport(
                index=i,
                counts=[int(c) for c in result.matrix[i]],
                value=None if result.erased[i] else int(result.blocks[i]),
                margin=int(result.margin[i]),
                confidence=float(result.confidence[i]),
                erased=bool(result.erased[i]),
            )
            for i in range(result.matrix.shape[0])
        ],
        attribution=None
        if attributed is None
        else AttributionReport(
            user_id=int(attributed.id),  # type: ignore[call-overload]
            name=name_of(attributed.id),
            confidence=attribution.confidence,
            p_value=min(1.0, attributed.p_value * tries),
        ),
        candidates=[
            CandidateReport(
                user_id=int(c.id),  # type: ignore[call-overload]
                name=name_of(c.id),
                score=c.score,
                p_value=min(1.0, c.p_value * tries),
                hamming=c.hamming,
            )
            for c in attribution.candidates
        ],
        tokens=_token_reports(tokenizer, ids, result) if include_tokens else None,
    )
    return TraceOutcome(
        report,
        best.handle.id,
        None if attributed is None else int(attributed.id),  # type: ignore[call-overload]
    )


async def prepare_null_distributions(keyring: Keyring, max_row_tokens: int) -> None:
    """Simulate the per-row null distributions that /trace's test needs, for rows of 1 to
    ``max_row_tokens`` tokens and the parameters of every usable key version.

    Each row size is simulated once per process (about 0.1 s of one core) and cached; without
    this, the first traces after start-up pay for it inline. Runs on a worker thread, one row
    size at a time, so it can be cancelled between sizes and the event loop keeps serving.
    """
    started = time.perf_counter()
    done: list[object] = []
    try:
        for handle in keyring.usable():
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


class TracingService:
    def __init__(
        self,
        session: AsyncSession,
        records: RowWriter,
        settings: Settings,
        backend: Backend,
        keyring: Keyring,
        metrics: Metrics,
        registry: RegistryCache,
    ) -> None:
        self._session = session
        self._records = records
        self._settings = settings
        self._backend = backend
        self._keyring = keyring
        self._metrics = metrics
        self._registry = registry

    async def trace(self, principal: Principal, request: TraceRequest) -> TraceReport:
        settings = self._settings
        if len(request.text) > settings.max_trace_chars:
            raise PayloadTooLargeError(f"text is longer than {settings.max_trace_chars} characters", param="text")
        if request.model is not None and request.model != self._backend.model_id:
            raise NotFoundError(f"The model '{request.model}' does not exist", param="model", code="model_not_found")
        tokenizer = self._backend.tokenizer
        if tokenizer is None:
            raise ServiceUnavailableError("The tokenizer is still loading; retry shortly")
        versions = self._keyring.usable()
        if not versions:
            raise ServiceUnavailableError("No usable watermark key version is configured")
        snapshot = await self._registry.snapshot(self._session)
        if len(request.text) <= INLINE_ANALYSIS_CHARS:
            outcome = analyze_text(
                request.text,
                tokenizer,
                versions,
                snapshot,
                alpha=settings.trace_alpha,
                include_tokens=request.include_tokens,
            )
        else:
            outcome = await asyncio.to_thread(
                analyze_text,
                request.text,
                tokenizer,
                versions,
                snapshot,
                alpha=settings.trace_alpha,
                include_tokens=request.include_tokens,
            )
        report = outcome.report
        verdict = TraceVerdict.WATERMARKED if report.watermarked else TraceVerdict.NOT_WATERMARKED
        row = {
            "requester_id": principal.user_id,
            "verdict": verdict,
            "p_value": report.p_value,
            "statistic": report.statistic,
            "scored_tokens": report.scored_tokens,
            "key_version_id": outcome.key_version_id,
            "attributed_user_id": outcome.attributed_user_id,
            "created_at": utcnow(),
        }
        # committed before the report is sent; concurrent traces share the round trip (RowWriter)
        await self._records.write([row])
        self._metrics.trace_verdicts.labels(
            verdict=verdict, attributed="yes" if outcome.attributed_user_id is not None else "no"
        ).inc()
        return report


async def offline_trace_async(settings: Settings, text: str) -> dict[str, Any]:
    """The /trace report of ``text`` computed from the configuration alone (no server, no record)."""
    import os

    from transformers import AutoTokenizer

    from service.config import load_secrets
    from service.db import create_engine, create_sessionmaker
    from service.keyring import Keyring, params_from_settings

    if len(text) > settings.max_trace_chars:
        raise PayloadTooLargeError(f"text is longer than {settings.max_trace_chars} characters", param="text")
    os.environ["HF_HUB_OFFLINE"] = "1"
    tokenizer = AutoTokenizer.from_pretrained(settings.resolved_model_path(), local_files_only=True)
    params = params_from_settings(settings)
    keyring = Keyring(params, load_secrets(settings).watermark)
    engine = create_engine(settings)
    try:
        sessionmaker = create_sessionmaker(engine)
        async with sessionmaker() as session:
            await keyring.refresh(session)
            snapshot = await RegistryCache(sessionmaker, params).snapshot(session)
    finally:
        await engine.dispose()
    versions = keyring.usable()
    if not versions:
        raise ServiceUnavailableError("No usable watermark key version is configured")
    outcome = await asyncio.to_thread(analyze_text, text, tokenizer, versions, snapshot, alpha=settings.trace_alpha)
    return outcome.report.model_dump()


def offline_trace(settings: Settings, text: str) -> dict[str, Any]:
    """Synchronous entry point of :func:`offline_trace_async` (for the command line)."""
    return asyncio.run(offline_trace_async(settings, text))
