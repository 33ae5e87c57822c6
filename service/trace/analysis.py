"""The trace report of a text: decode the watermark under each key version, test it, name the
user it encodes. Pure computation (no I/O); the tracing service and the offline CLI call it.

The text is tokenized with the served model's tokenizer (no chat template; special tokens are
skipped by the decoders). Every usable key version is tried and the one that explains the text
best (smallest p-value) is reported. Attribution scores the text against every registered message
ID, deleted users' tombstones included.

Two decoders: counting (``analyze_counting``: the cTMM, no model needed) and likelihood
(``analyze_likelihood``: each token weighted by the served model's own next-token distribution,
which the service fetches from the backend). ``multiplicity`` (an ``xmark_core.Multiplicity``) is
every test a trace may run on the same text (candidate sets × key versions × encoders × decoders),
counted in one place (``service.trace.plan``) and applied by the decoders (with the salts and the
candidate set's size): every p-value is corrected by it, so the verdict stays valid at ``alpha``
whichever test decides.

Key versions of different message lengths (bits, block_bits) coexist, and a reading under a version
is scored against the registry of that version's length. ``analyze_counting_by_length`` and
``analyze_likelihood_by_length`` analyse each length group (``LengthGroup``: its versions and its
snapshot) and keep the outcome with the smallest p-value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from service.keyring import KeyVersionHandle
from service.services.registry_cache import RegistrySnapshot
from service.trace.policy import TracePolicy
from service.trace.schemas import (
    AttributionReport,
    BlockReport,
    CandidateReport,
    EndUserRef,
    TokenReport,
    TraceReport,
)
from service.vocabulary import TraceDecoder
from xmark_core import (
    Attribution,
    DecodeResult,
    Detection,
    GumbelLikelihoodResult,
    LikelihoodAttribution,
    LikelihoodResult,
    ModelScores,
    Multiplicity,
    attribute,
    attribute_gumbel_likelihood,
    attribute_likelihood,
    decode,
    detect,
    identity_p,
    score_gumbel_text,
    score_text,
)
from xmark_core.detect import sigma_statistic

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOP_CANDIDATES = 5
_REPLACEMENT = "\ufffd"
COUNTING_TEST = (
    "counting: exact binomial tail of the decoded counts, corrected for the registry size, "
    "the key versions and the decoders tried"
)
LIKELIHOOD_TEST = (
    "likelihood: exact weighted-Bernoulli tail under the keyed-hash null, corrected for the "
    "registry size, the key versions and the decoders tried"
)
# the distortion-free scheme's readings (key versions of scheme gumbel)
GUMBEL_COUNTING_TEST = (
    "counting: exact Gamma tail of the keyed scores, corrected for the registry size, the key versions "
    "and the decoders tried; a name also needs the identity test against every other registered ID"
)
GUMBEL_LIKELIHOOD_TEST = (
    "likelihood: exact tail of the grid-rounded log-likelihood ratio under the keyed-hash null, corrected "
    "for the registry size, the key versions and the decoders tried; a name also needs the identity test "
    "against every other registered ID"
)


@dataclass(frozen=True)
class TraceOutcome:
    report: TraceReport
    key_version_id: int | None
    # the named holder's number in the registry (``service.parties``: an account's user id, or the
    # negative of an end user's id); the report names the account and the end user
    attributed_user_id: int | None
    # the corrected p-value the reading was chosen by among key versions (smaller = stronger):
    # counting, the smaller of the detection and the best candidate's; likelihood, the best candidate's
    strength: float = 1.0
    # the posterior confidence of the best-ranked candidate among this test's candidates (named or not)
    confidence: float = 0.0
    # the identity test of the named user against the leads it was given (``lead_identity_p``);
    # None: not asked for, nobody named, the named user is a lead, or no lead holds an ID here
    lead_identity_p: float | None = None

    @property
    def named(self) -> bool:
        return self.attributed_user_id is not None


@dataclass(frozen=True)
class _Reading:
    handle: KeyVersionHandle
    result: DecodeResult
    detection: Detection
    attribution: Attribution

    @property
    def strength(self) -> float:
        """The smaller of the corrected detection p-value and the best candidate's (both corrected)."""
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
        test=COUNTING_TEST,
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
    """The number a registry snapshot gave its candidate (an int, or a numpy integer): an account's
    user id, or the negative of an end user's id (``service.parties``)."""
    assert isinstance(candidate_id, int | np.integer)
    return int(candidate_id)


@dataclass(frozen=True)
class _Holder:
    """Who a candidate's message ID belongs to, as a report names them."""

    user_id: int
    name: str
    end_user: EndUserRef | None


def _holder(snapshot: RegistrySnapshot, candidate_id: object) -> _Holder:
    key = _user_id(candidate_id)
    user = snapshot.users.get(key)
    if user is None:
        return _Holder(key, "", None)
    end_user = None
    if user.end_user_id is not None:
        end_user = EndUserRef(id=user.end_user_id, identifier=user.identifier or "")
    return _Holder(user.user_id, user.name, end_user)


def _attribution_report(
    snapshot: RegistrySnapshot, candidate_id: object, confidence: float, p_value: float
) -> AttributionReport:
    holder = _holder(snapshot, candidate_id)
    return AttributionReport(
        user_id=holder.user_id, name=holder.name, confidence=confidence, p_value=p_value, end_user=holder.end_user
    )


def _candidate_report(
    snapshot: RegistrySnapshot, candidate_id: object, score: float, p_value: float, hamming: int
) -> CandidateReport:
    holder = _holder(snapshot, candidate_id)
    return CandidateReport(
        user_id=holder.user_id,
        name=holder.name,
        score=score,
        p_value=p_value,
        hamming=hamming,
        end_user=holder.end_user,
    )


def _pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """The text of each token, such that the pieces join to the decoded text.

    A byte-level token may end inside a multi-byte character (decoded alone it is U+FFFD): the
    character then belongs to the token that completes it, and the tokens before it get "".
    """

    def text_of(chunk: list[int]) -> str:
        text = tokenizer.decode(chunk, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    pieces: list[str] = []
    start = done = 0  # decoding window start; tokens before ``done`` have their text
    for end in range(1, len(ids) + 1):
        before, after = text_of(ids[start:done]), text_of(ids[start:end])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            pieces.append(after[len(before) :])
            start, done = done, end
        else:
            pieces.append("")
    if done < len(ids):  # the text ends inside a character: the last token shows what decodes
        pieces[-1] = text_of(ids[start:])[len(text_of(ids[start:done])) :]
    return pieces


Evidence = Literal["supports", "contradicts"]


def candidate_blocks(bits: str, block_bits: int) -> list[int]:
    """The block values of a candidate's message bits (``block_bits`` bits each, most significant first)."""
    return [int(bits[i : i + block_bits], 2) for i in range(0, len(bits), block_bits)]


def token_evidence(
    result: DecodeResult, blocks: Sequence[int] | None = None, llr: np.ndarray | None = None
) -> list[Evidence | None]:
    """Each token's evidence for one candidate, so a reader sees where the text agrees with it.

    With the likelihood decoder's per-token ``llr`` (NaN = not scored): its sign. Otherwise, with
    the candidate's block values ``blocks``: a scored token supports the candidate when it lies in
    the list the candidate's message would have boosted in its block: for xmark/loso the evergreen
    list (its shard differs from the block value under every key), for mpac the shard numbered by
    the block value; else it contradicts. Unscored tokens (context, special, repeated) and a text
    without a candidate have no evidence.
    """
    assert result.token_blocks is not None and result.token_shards is not None
    n = result.token_blocks.shape[0]
    if llr is not None:
        return [
            None if np.isnan(value) or value == 0 else ("supports" if value > 0 else "contradicts")
            for value in llr.tolist()
        ]
    if blocks is None:
        return [None] * n
    values = np.asarray(blocks, dtype=np.int64)
    scored = result.token_blocks >= 0
    expected = values[np.where(scored, result.token_blocks, 0)][:, None]  # [n, 1]
    if result.params.distortion_free:  # gumbel: the token's best value (see decoder) is the candidate's
        boosted = result.token_shards[:, 0] == expected[:, 0]
    elif result.params.scheme == "mpac":
        boosted = (result.token_shards[:, :1] == expected).all(axis=1)
    else:
        boosted = (result.token_shards != expected).all(axis=1)
    return [
        None if not is_scored else ("supports" if is_boosted else "contradicts")
        for is_scored, is_boosted in zip(scored.tolist(), boosted.tolist(), strict=True)
    ]


def _token_reports(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    result: DecodeResult,
    llr: np.ndarray | None = None,
    candidate_bits: str | None = None,
) -> list[TokenReport]:
    """The per-token view of a text; ``candidate_bits``: the message of the named or best
    candidate, whose evidence each token carries (with ``llr``, its sign decides instead)."""
    assert result.token_blocks is not None and result.token_shards is not None
    blocks = None if candidate_bits is None else candidate_blocks(candidate_bits, result.params.block_bits)
    evidence = token_evidence(result, blocks, llr)
    reports = []
    pieces = _pieces(tokenizer, ids)
    for position, token in enumerate(ids):
        block = int(result.token_blocks[position])
        value = None if llr is None or np.isnan(llr[position]) else float(llr[position])
        reports.append(
            TokenReport(
                text=pieces[position],
                id=token,
                block=None if block < 0 else block,
                shards=None if block < 0 else [int(s) for s in result.token_shards[position]],
                llr=value,
                evidence=evidence[position],
            )
        )
    return reports


def _block_reports(result: DecodeResult, scores: np.ndarray | None = None) -> list[BlockReport]:
    return [
        BlockReport(
            index=i,
            counts=[int(c) for c in result.matrix[i]],
            value=None if result.erased[i] else int(result.blocks[i]),
            margin=int(result.margin[i]),
            confidence=float(result.confidence[i]),
            erased=bool(result.erased[i]),
            scores=None if scores is None else [float(s) for s in scores[i]],
        )
        for i in range(result.matrix.shape[0])
    ]


@dataclass(frozen=True)
class LengthGroup:
    """The usable key versions of one message length and the registry snapshot of that length."""

    versions: tuple[KeyVersionHandle, ...]
    snapshot: RegistrySnapshot


def group_by_length(versions: Sequence[KeyVersionHandle]) -> list[tuple[KeyVersionHandle, ...]]:
    """``versions`` grouped by message length (bits, block_bits), each group and the groups in
    their order in ``versions`` (so the active version's group comes first)."""
    groups: dict[tuple[int, int], list[KeyVersionHandle]] = {}
    for handle in versions:
        params = handle.key.params
        groups.setdefault((params.bits, params.block_bits), []).append(handle)
    return [tuple(group) for group in groups.values()]


def _strongest(outcomes: Sequence[TraceOutcome]) -> TraceOutcome:
    """The outcome that names someone, else the one with the smallest p-value; the first one (the
    active version's length) on ties. Each group's naming is valid at alpha on its own (every
    p-value is corrected for all the versions tried), so a name is never hidden by another
    length's stronger detection."""
    return min(outcomes, key=lambda outcome: (not outcome.named, outcome.strength))


def lead_identity_p(
    result: DecodeResult | LikelihoodResult | GumbelLikelihoodResult,
    snapshot: RegistrySnapshot,
    named: int,
    leads: Sequence[int],
) -> float | None:
    """The largest p-value, over the ``leads`` (user ids) other than the ``named`` user, that the
    text carries that lead's message ID rather than the named user's (``xmark_core.identity_p``,
    the decoder's own identity test). None when the named user is a lead, no lead holds an ID of
    this length, or the decoder has no identity test for this key version."""
    if named in leads:
        return None
    restricted = snapshot.restricted([named, *leads])
    if len(restricted) < 2 or _user_id(restricted.candidates.ids[0]) != named:
        return None
    return identity_p(result, restricted.candidates, 0)


def analyze_counting_by_length(
    ids: list[int],
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[LengthGroup],
    *,
    policy: TracePolicy,
    include_tokens: bool = False,
    multiplicity: Multiplicity,
    leads: Sequence[int] = (),
) -> TraceOutcome:
    """``analyze_counting`` of each length group, every p-value corrected for ``multiplicity``; the
    outcome that names someone, else the one with the smallest p-value. ``leads``: as for
    :func:`analyze_counting`."""
    return _strongest(
        [
            analyze_counting(
                ids,
                tokenizer,
                group.versions,
                group.snapshot,
                policy=policy,
                include_tokens=include_tokens,
                multiplicity=multiplicity,
                leads=leads,
            )
            for group in groups
        ]
    )


def analyze_likelihood_by_length(
    ids: list[int],
    scores: ModelScores,
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[LengthGroup],
    *,
    policy: TracePolicy,
    counting: TraceOutcome | None = None,
    include_tokens: bool = False,
    multiplicity: Multiplicity,
    leads: Sequence[int] = (),
) -> TraceOutcome:
    """``analyze_likelihood`` of each length group, every p-value corrected for ``multiplicity``;
    the outcome that names someone, else the one with the smallest p-value. ``leads``: as for
    :func:`analyze_counting`."""
    return _strongest(
        [
            analyze_likelihood(
                ids,
                scores,
                tokenizer,
                group.versions,
                group.snapshot,
                policy=policy,
                counting=counting,
                include_tokens=include_tokens,
                multiplicity=multiplicity,
                leads=leads,
            )
            for group in groups
        ]
    )


def analyze_counting(
    ids: list[int],
    tokenizer: PreTrainedTokenizerBase,
    versions: Sequence[KeyVersionHandle],
    snapshot: RegistrySnapshot,
    *,
    policy: TracePolicy,
    include_tokens: bool = False,
    multiplicity: Multiplicity,
    leads: Sequence[int] = (),
) -> TraceOutcome:
    """The counting decoder's report of the text with token ids ``ids``.

    ``multiplicity``: the tests run on the text in all (``plan.FanoutPlan.multiplicity``; at least
    the key readings read here, all of one message length, that of ``snapshot``): every p-value is
    corrected for them. ``leads``: users a content search led to; a naming of someone else gets
    the identity test against them (``TraceOutcome.lead_identity_p``)."""
    params = versions[0].key.params
    if len(ids) < 3:  # the first two tokens are context only: nothing to score
        report = _empty_report(params.bits, params.block_bits)
        if include_tokens:
            report.tokens = [
                TokenReport(text=piece, id=t, block=None, shards=None)
                for t, piece in zip(ids, _pieces(tokenizer, ids), strict=True)
            ]
        return TraceOutcome(report, None, None)
    special = tokenizer.all_special_ids
    counting_rule = policy.with_identity_level(None).naming_rule()
    # Several key versions, decoders and candidate sets are several tests: the decoders correct
    # every p-value for them (Bonferroni).
    multiplicity.check_readings(len(versions))
    best: _Reading | None = None
    for handle in versions:
        result = decode(ids, handle.key, skip_ids=special, per_token=include_tokens)
        reading = _Reading(
            handle,
            result,
            # the report has no sigma p-value
            detect(result, alpha=policy.alpha, sigma_test=False, multiplicity=multiplicity),
            # the counting decoder's naming never waits on the identity level: with one, the fan-out
            # takes counting's verdict but not its name
            attribute(result, snapshot.candidates, top=TOP_CANDIDATES, multiplicity=multiplicity, rule=counting_rule),
        )
        if best is None or reading.strength < best.strength:
            best = reading
    assert best is not None
    result, detection, attribution = best.result, best.detection, best.attribution
    attributed = attribution.best
    # A naming is itself a rejection of unwatermarked text (the attribution test, corrected for the
    # registry and the tries, at alpha): the report then says watermarked, with the smaller p-value,
    # whatever the detection test of the counts (a different statistic) says.
    p_value = detection.p_value
    if attributed is not None:
        p_value = min(p_value, attribution.p_value)
    report = TraceReport(
        decoder=TraceDecoder.COUNTING,
        test=GUMBEL_COUNTING_TEST if result.params.distortion_free else COUNTING_TEST,
        confidence=attribution.confidence,
        margin=attribution.margin if attribution.candidates else None,
        watermarked=detection.is_watermarked or attributed is not None,
        p_value=p_value,
        statistic=detection.statistic,
        scored_tokens=result.scored_tokens,
        key_version=best.handle.name,
        encoder=best.handle.encoder,
        # the paper's false-positive statistic (mean of the cTMM rows' standard deviations), biasing
        # encoders only; the decision rests on p_value, which is calibrated for this text's length
        sigma=None if result.params.distortion_free else sigma_statistic(result),
        decoded_message=result.bits,
        blocks=_block_reports(result),
        attribution=None
        if attributed is None
        else _attribution_report(snapshot, attributed.id, attribution.confidence, attributed.p_value),
        candidates=[_candidate_report(snapshot, c.id, c.score, c.p_value, c.hamming) for c in attribution.candidates],
        tokens=_token_reports(
            tokenizer, ids, result, candidate_bits=attribution.candidates[0].bits if attribution.candidates else None
        )
        if include_tokens
        else None,
    )
    named_user = None if attributed is None else _user_id(attributed.id)
    return TraceOutcome(
        report,
        best.handle.id,
        named_user,
        strength=best.strength,
        confidence=attribution.confidence,
        lead_identity_p=None if named_user is None else lead_identity_p(result, snapshot, named_user, leads),
    )


@dataclass(frozen=True)
class _LikelihoodReading:
    handle: KeyVersionHandle
    result: LikelihoodResult | GumbelLikelihoodResult
    attribution: LikelihoodAttribution


def analyze_likelihood(
    ids: list[int],
    scores: ModelScores,
    tokenizer: PreTrainedTokenizerBase,
    versions: Sequence[KeyVersionHandle],
    snapshot: RegistrySnapshot,
    *,
    policy: TracePolicy,
    counting: TraceOutcome | None = None,
    include_tokens: bool = False,
    multiplicity: Multiplicity,
    leads: Sequence[int] = (),
) -> TraceOutcome:
    """The likelihood decoder's report of the text with token ids ``ids`` (``len(ids) >= 3``).

    ``counting``: the counting decoder's outcome on the same text under ``decoder=auto``: its
    verdict counts too (both were corrected for the whole multiplicity). ``multiplicity``: as for
    :func:`analyze_counting`. ``policy``: the naming rule and the reading's parameters (its
    identity level as for ``xmark_core.attribute_likelihood``; the report gives the level and the
    best candidate's identity p-value). ``leads``: as for :func:`analyze_counting`.
    """
    special = tokenizer.all_special_ids
    multiplicity.check_readings(len(versions))
    rule = policy.naming_rule()
    alpha, temperature, edit_rate = policy.alpha, policy.temperature, policy.edit_rate
    best: _LikelihoodReading | None = None
    for handle in versions:
        result: LikelihoodResult | GumbelLikelihoodResult
        if handle.key.params.distortion_free:  # the gumbel scheme: its own model-aware reading
            result = score_gumbel_text(
                ids, scores, handle.key, temperature=temperature, edit_rate=edit_rate, skip_ids=special
            )
            attribution = attribute_gumbel_likelihood(
                result, snapshot.candidates, top=TOP_CANDIDATES, multiplicity=multiplicity, rule=rule
            )
        else:
            result = score_text(ids, scores, handle.key, temperature=temperature, edit_rate=edit_rate, skip_ids=special)
            attribution = attribute_likelihood(
                result, snapshot.candidates, top=TOP_CANDIDATES, multiplicity=multiplicity, rule=rule
            )
        if best is None or attribution.p_value < best.attribution.p_value:
            best = _LikelihoodReading(handle, result, attribution)
    assert best is not None
    handle, result, attribution = best.handle, best.result, best.attribution

    counted = decode(ids, handle.key, skip_ids=special, per_token=include_tokens)  # the counts, for the view
    top = attribution.candidates[0] if attribution.candidates else None
    llr = None
    if include_tokens and top is not None:
        llr = result.token_llr(candidate_blocks(top.bits, result.params.block_bits))
    watermarked = attribution.p_value < alpha
    p_value = attribution.p_value
    if counting is not None:  # decoder=auto: either verdict stands (each was corrected for every test)
        watermarked = watermarked or counting.report.watermarked
        p_value = min(p_value, counting.report.p_value)
    named = attribution.best
    report = TraceReport(
        decoder=TraceDecoder.LIKELIHOOD,
        test=GUMBEL_LIKELIHOOD_TEST if result.params.distortion_free else LIKELIHOOD_TEST,
        temperature=result.temperature,
        edit_rate=result.edit_rate,
        confidence=attribution.confidence,
        margin=attribution.margin if attribution.candidates else None,
        watermarked=watermarked,
        p_value=p_value,
        statistic=top.score if top is not None else 0.0,
        scored_tokens=result.scored_tokens,
        key_version=handle.name,
        encoder=handle.encoder,
        sigma=None if handle.key.params.distortion_free else sigma_statistic(counted),
        decoded_message=result.bits,
        blocks=_block_reports(counted, result.scores),
        attribution=None
        if named is None
        else _attribution_report(snapshot, named.id, attribution.confidence, named.p_value),
        candidates=[_candidate_report(snapshot, c.id, c.score, c.p_value, c.hamming) for c in attribution.candidates],
        tokens=_token_reports(tokenizer, ids, counted, llr) if include_tokens else None,
        identity_level=policy.identity_level,
        identity_p_value=attribution.identity_p_value,
    )
    named_user = None if named is None else _user_id(named.id)
    return TraceOutcome(
        report,
        handle.id,
        named_user,
        strength=attribution.p_value,
        confidence=attribution.confidence,
        lead_identity_p=None if named_user is None else lead_identity_p(result, snapshot, named_user, leads),
    )
