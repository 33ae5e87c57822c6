"""The trace report of a text: decode the watermark under each key version, test it, name the
user it encodes. Pure computation (no I/O); the tracing service and the offline CLI call it.

The text is tokenized with the served model's tokenizer (no chat template; special tokens are
skipped by the decoder). Every usable key version is tried and the one that explains the text
best (smallest p-value) is reported. Attribution scores the decoded counts against every
registered message ID, deleted users' tombstones included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.keyring import KeyVersionHandle
from service.schemas.trace import (
    AttributionReport,
    BlockReport,
    CandidateReport,
    TokenReport,
    TraceReport,
)
from service.services.registry_cache import RegistrySnapshot
from xmark_core import Attribution, DecodeResult, Detection, attribute, decode, detect

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOP_CANDIDATES = 5


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


def _user_id(candidate_id: object) -> int:
    """The user id a registry snapshot gave its candidate (an int, or a numpy integer)."""
    assert isinstance(candidate_id, int | np.integer)
    return int(candidate_id)


def _piece(tokenizer: PreTrainedTokenizerBase, token: int) -> str:
    """The text of one token, as the tokenizer decodes it alone."""
    text = tokenizer.decode([token], clean_up_tokenization_spaces=False)
    assert isinstance(text, str)  # one sequence of ids decodes to one string
    return text


def _token_reports(tokenizer: PreTrainedTokenizerBase, ids: list[int], result: DecodeResult) -> list[TokenReport]:
    assert result.token_blocks is not None and result.token_shards is not None
    pieces = [_piece(tokenizer, token) for token in ids]
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
            report.tokens = [TokenReport(text=_piece(tokenizer, t), id=t, block=None, shards=None) for t in ids]
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
        user = users.get(_user_id(user_id))
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
            user_id=_user_id(attributed.id),
            name=name_of(attributed.id),
            confidence=attribution.confidence,
            p_value=min(1.0, attributed.p_value * tries),
        ),
        candidates=[
            CandidateReport(
                user_id=_user_id(c.id),
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
        None if attributed is None else _user_id(attributed.id),
    )
