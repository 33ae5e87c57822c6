"""The model-aware decoder of the distortion-free scheme ``gumbel``: each token weighted by what the
model's own distribution says it can carry.

The counting decoder of ``gumbel`` (:mod:`xmark_core.gumbel`) adds s = -log(1 - u) of every scored
token, u being the token's keyed uniform under a block value. A token the model was sure of (a word's
second half at temperature 0.7) adds a full Exp(1) of noise to that sum and no evidence: exponential
sampling picks it whatever u says. Given the model's probability p of the text's own token at the
request's temperature, the likelihood of u is known exactly. The encoder picks x = argmax_w
u(w)^(1/p(w)); the winning value M = u(x)^(1/p(x)) is Uniform(0, 1) and independent of which token
won, so the chosen token's uniform is u = M^p, whose density is (1/p) u^(1/p - 1). Joined with the
probability that x is the text's token (p), the watermark gives (x, u) the density u^(1/p - 1); an
edit (any of the V tokens, with probability eps) gives 1/V, uniform in u. Against the same text
without this key's value (the model or an edit, u uniform), the log-likelihood ratio of a position
for block value v is

    g_t(v) = log((1 - eps) u_t(v)^(1/p_t - 1) + eps / V) - log((1 - eps) p_t + eps / V)

clipped below at ``LLR_FLOOR`` (one implausibly small u costs at most that much: an edited token, a
token the model nearly ruled out, adds little either way). Where the model was sure (p_t -> 1), g_t
is 0 whatever u is; where it had a choice, a u near 1 is strong evidence.

Why the p-values are exact. On a text not written with this key and value, the scored tokens' u_t(v)
are independent and uniform (distinct contexts, keyed hash), and p_t is computed from the text alone,
so it is independent of them: each g_t is a known function of one uniform. Every g_t is put on a grid
of step h (nats) by rounding up, giving integer units k_t(v) = ceil(g_t(v) / h); the naming statistic
of a candidate message m is K(m) = sum_t k_t(m_{i_t}), and its null distribution is the convolution of
the per-token laws P(k_t = k) = P(g_t in ((k-1)h, kh]) (u is one of the 2**32 values (j + 0.5) / 2**32,
so these are exact rationals computed in float64). Every convolution is of non-negative arrays, so the
tail keeps full relative precision however small it is. The same null holds for every candidate (the
weights depend on the text, not on the key), so the best candidate's p-value is one tail, corrected
for the registry size and the tests tried (Bonferroni). The test is exact for its (rounded) statistic;
the grid changes its power only.

The identity test of the best candidate against a rival c uses the best's units over the blocks where
the two differ: if c wrote the text, the best's values there are not c's, their uniforms are
independent of the text, and the sum's null is the convolution of those blocks' laws (a Chernoff
bound screens the whole registry first, as in :func:`xmark_core.likelihood.identity_test`).

Salts (``params.salts`` S > 1): every token is scored under all D * S salted values, the salt whose best
message has the largest summed LLR is kept (``gumbel.pick_salt``) and every p-value is multiplied by S
(union bound over salts).

Which positions are scored. The encoder samples a context that already occurred in the answer
normally (``gumbel.repeated_context``): such a token carries no watermark. So only the first position
of every context (x[t-2], x[t-1]) is scored; the first two tokens are context only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .attribution import CandidateScore, CandidateSet, _hamming_blocks, difference_patterns, largest_exact_p
from .errors import ParamsError
from .gumbel import hashed, pick_salt, value_codes
from .hashing import block_index, context_multipliers, token_codes
from .keys import WatermarkKey
from .likelihood import (
    DEFAULT_EDIT_RATE,
    DEFAULT_TEMPERATURE,
    BlockScores,
    LikelihoodAttribution,
    ModelScores,
    checked_text,
    rank_by_likelihood,
    tempered,
)
from .naming import DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, Multiplicity, NamingRule, check_ranking, rule_of
from .params import WatermarkParams

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# grid steps per nat of the rounded log-likelihood ratio
STEPS_PER_NAT = 20
# a position's log-likelihood ratio is clipped below here (nats)
LLR_FLOOR = -4.0
# the whole text's null law has at most this many cells; a longer text uses a coarser grid
MAX_CELLS = 1 << 15
# the Chernoff bound's exponents, per nat
_CHERNOFF_LAMBDAS = np.geomspace(0.02, 8.0, 28)
MAX_EXACT_RIVALS = 64
_DRAWS = float(1 << 32)
# the smallest p-value reported (below it float64 underflows)
P_FLOOR = 1e-300

BOUND = "exact tail of the grid-rounded log-likelihood ratio under the keyed-hash null, Bonferroni over the registry"


@dataclass(frozen=True)
class GumbelLikelihoodResult(BlockScores):
    """What the model-aware ``gumbel`` decoder read from one text under one key.

    scores: float64 [r, D] S[i, v], the sum of g_t(v) over block i; units: int64 [r, D] the same on
    the grid (sum of k_t(v)); row_counts: int64 [r] scored tokens per block; positions: int64 [m]
    the text positions scored; rows: int64 [m] their blocks; llr: float64 [m, D] g_t(v);
    step: the grid's step (nats); block_laws: per block, (offset, pmf) of its units' null law;
    salt: the salt read (with ``params.salts`` > 1; the arrays are that salt's).
    """

    params: WatermarkParams
    temperature: float
    text_length: int
    scores: FloatArray
    units: IntArray
    row_counts: IntArray
    positions: IntArray
    rows: IntArray
    llr: FloatArray = field(repr=False)
    step: float = 1.0 / STEPS_PER_NAT
    block_laws: tuple[tuple[int, FloatArray], ...] = field(default=(), repr=False)
    edit_rate: float = 0.0
    salt: int = 0

    def token_llr(self, blocks: Sequence[int] | IntArray) -> FloatArray:
        """float64 [text_length]: each position's g_t (nats) for a message with these block values;
        NaN where the position was not scored."""
        values = np.asarray(blocks, dtype=np.int64)[self.rows]
        out = np.full(self.text_length, np.nan)
        out[self.positions] = self.llr[np.arange(self.rows.size), values]
        return out

    def null_law(self, blocks: Iterable[int] | None = None) -> tuple[int, FloatArray]:
        """(offset, pmf) of the units summed over these blocks (all by default) on a text that does
        not carry the values being scored: pmf[j] = P(sum = offset + j)."""
        chosen = range(len(self.block_laws)) if blocks is None else blocks
        return _convolve_laws([self.block_laws[i] for i in chosen])

    def tail(self, observed: int, blocks: Iterable[int] | None = None) -> float:
        """P(units summed over these blocks >= observed) under the null, exactly."""
        chosen = range(len(self.block_laws)) if blocks is None else blocks
        return float(_tails([self.block_laws[i] for i in chosen], np.array([observed], dtype=np.int64))[0])


def _scored_positions(ids: IntArray, skip: IntArray, dedup: bool) -> IntArray:
    """The positions t >= 2 scored: the first of each context (x[t-2], x[t-1]), not a skipped token."""
    prev2, prev1, token = ids[:-2], ids[1:-1], ids[2:]
    keep = np.ones(token.size, dtype=bool)
    if skip.size:
        keep &= ~np.isin(token, skip)
    if dedup:
        contexts = (prev2 << 32) | prev1  # ids < 2**31: one exact key per context
        _, first = np.unique(contexts, return_index=True)
        once = np.zeros(token.size, dtype=bool)
        once[first] = True
        keep &= once
    return np.flatnonzero(keep) + 2


def _llr(log_u: FloatArray, excess: FloatArray, log_norm: FloatArray, edit_rate: float, vocab: int) -> FloatArray:
    """g = log((1 - eps) u^(a - 1) + eps / V) - log_norm, clipped below at LLR_FLOOR (broadcasting)."""
    generated = math.log1p(-edit_rate) + excess * log_u
    if edit_rate > 0.0:
        generated = np.logaddexp(generated, math.log(edit_rate / vocab))
    out: FloatArray = np.maximum(generated - log_norm, LLR_FLOOR)
    return out


def _uniform_cdf(log_x: FloatArray) -> FloatArray:
    """P(U <= x) for U uniform on the 2**32 values (j + 0.5) / 2**32, from log x (elementwise)."""
    with np.errstate(over="ignore"):
        x = np.exp(np.minimum(log_x, 0.0))
    out: FloatArray = np.clip(np.floor(x * _DRAWS - 0.5) + 1.0, 0.0, _DRAWS) / _DRAWS
    return out


def _token_laws(
    excess: FloatArray, log_norm: FloatArray, edit_rate: float, vocab: int, step: float
) -> tuple[IntArray, list[FloatArray]]:
    """Per scored token: the lowest unit k_min and P(k = k_min + j) for j = 0, 1, ... under the null."""
    log_lo = math.log(0.5 / _DRAWS)
    log_hi = math.log1p(-0.5 / _DRAWS)
    lo = _llr(np.full_like(excess, log_lo), excess, log_norm, edit_rate, vocab)
    hi = _llr(np.full_like(excess, log_hi), excess, log_norm, edit_rate, vocab)
    k_lo = np.ceil(lo / step).astype(np.int64)
    k_hi = np.ceil(hi / step).astype(np.int64)
    width = int((k_hi - k_lo).max()) + 1 if excess.size else 1
    ks = k_lo[:, None] + np.arange(width)[None, :]  # [m, W]
    y = ks * step  # upper edge of each cell
    # g <= y  <=>  (1 - eps) u^(a - 1) <= e^(y + log_norm) - eps / V  <=>  log u <= ... / (a - 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        room = np.exp(y + log_norm[:, None]) - (edit_rate / vocab if edit_rate > 0.0 else 0.0)
        log_u = (np.log(room) - math.log1p(-edit_rate)) / excess[:, None]
    cdf = np.where(room > 0.0, _uniform_cdf(np.nan_to_num(log_u, nan=-np.inf, posinf=0.0)), 0.0)
    cdf[y < LLR_FLOOR - 1e-9] = 0.0  # below the floor (the tolerance: the grid edges are rounded)
    cdf[ks >= k_hi[:, None]] = 1.0  # the top cell holds the rest (also where a - 1 is 0)
    cdf = np.maximum.accumulate(cdf, axis=1)
    pmf = np.diff(cdf, axis=1, prepend=0.0)  # [m, W]
    spans = k_hi - k_lo + 1
    return k_lo, [pmf[t, : spans[t]] for t in range(excess.size)]


def _convolve_laws(laws: Sequence[tuple[int, FloatArray]]) -> tuple[int, FloatArray]:
    """The law of a sum of independent integer variables, each given as (offset, pmf): pairwise
    direct convolutions of non-negative arrays (full relative precision in every cell)."""
    if not laws:
        return 0, np.ones(1)
    offset = sum(first for first, _ in laws)
    parts = [pmf for _, pmf in laws]
    while len(parts) > 1:
        parts.sort(key=len)
        merged = [np.convolve(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            merged.append(parts[-1])
        parts = merged
    return offset, parts[0]


def _tails(laws: Sequence[tuple[int, FloatArray]], observed: IntArray) -> FloatArray:
    """P(sum >= o) for every o in ``observed``, the sum's terms independent with these laws. The
    terms are split into two halves of about equal support, each half's law convolved, and the tail
    read as sum_i P(A = i) P(B >= o - i): the largest convolution is never formed."""
    if len(laws) < 2:
        offset, pmf = _convolve_laws(laws)
        upper = np.append(np.cumsum(pmf[::-1])[::-1], 0.0)  # upper[j] = P(X >= offset + j)
        out: FloatArray = np.minimum(1.0, upper[np.clip(observed - offset, 0, pmf.size)])
        return out
    ordered = sorted(laws, key=lambda law: law[1].size)
    first, second, size_a, size_b = [], [], 0, 0
    for law in reversed(ordered):  # greedy balance of the two halves' supports
        if size_a <= size_b:
            first.append(law)
            size_a += law[1].size
        else:
            second.append(law)
            size_b += law[1].size
    offset_a, pmf_a = _convolve_laws(first)
    offset_b, pmf_b = _convolve_laws(second)
    upper_b = np.append(np.cumsum(pmf_b[::-1])[::-1], 0.0)  # P(B >= offset_b + j), j = 0 .. size
    shift = observed[:, None] - offset_a - offset_b - np.arange(pmf_a.size)[None, :]  # [O, |A|]
    tails = upper_b[np.clip(shift, 0, pmf_b.size)]  # P(B >= o - i)
    out = np.minimum(1.0, tails @ pmf_a)
    return out


def score_gumbel_text(
    token_ids: Sequence[int] | IntArray,
    scores: ModelScores,
    key: WatermarkKey,
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    edit_rate: float = DEFAULT_EDIT_RATE,
    skip_ids: Iterable[int] = (),
    dedup: bool = True,
) -> GumbelLikelihoodResult:
    """Score one text (its token ids, as the model read them) under a ``gumbel`` key, with the
    model's distribution ``scores`` (at temperature 1; read at ``temperature``)."""
    params = key.params
    if not params.distortion_free:
        raise ParamsError("score_gumbel_text reads scheme 'gumbel' only; biasing schemes are read by score_text()")
    ids = checked_text(token_ids, scores, temperature, edit_rate)
    n = ids.size
    r, values_n = params.num_blocks, params.num_shards
    positions = _scored_positions(ids, np.fromiter(skip_ids, dtype=np.int64), dedup)
    positions = positions[np.isfinite(scores.token_logprobs[positions])]
    p2, p1, tok = ids[positions - 2], ids[positions - 1], ids[positions]
    rows = block_index(p2, p1, r)  # [m]
    _, own_p, _, _ = tempered(scores, positions, tok, temperature)
    own_p = np.clip(own_p, 1e-300, 1.0)
    vocab = scores.vocab_size
    excess = np.maximum(1.0 / own_p - 1.0, 0.0)  # a - 1 = 1/p - 1 (0 where the model was sure)
    log_norm = np.log((1.0 - edit_rate) * own_p + edit_rate / vocab)  # [m]

    words = key.words
    multipliers = context_multipliers(words, p2, p1)[:, :1]  # [m, 1]
    codes = token_codes(words, tok)[:, :1]  # [m, 1]
    value_code = value_codes(words, np.arange(params.num_values, dtype=np.int64))[None, :]  # [1, D * S]
    draws = hashed(multipliers, codes, value_code)  # [m, D * S]
    log_u = np.log((draws.astype(np.float64) + 0.5) / _DRAWS)
    llr = _llr(log_u, excess[:, None], log_norm[:, None], edit_rate, vocab)  # [m, D * S]
    salt = 0
    if params.salts > 1:
        salted_scores = np.zeros((r, params.num_values))
        np.add.at(salted_scores, rows, llr)
        salt = pick_salt(salted_scores, np.bincount(rows, minlength=r), params.salts)
        llr = np.ascontiguousarray(llr[:, salt * values_n : (salt + 1) * values_n])  # [m, D]

    # the grid: STEPS_PER_NAT steps per nat unless the text's null law would exceed MAX_CELLS
    step = 1.0 / STEPS_PER_NAT
    if positions.size:
        span = float(
            (
                _llr(np.zeros(1), excess, log_norm, edit_rate, vocab)
                - _llr(np.full(1, -40.0), excess, log_norm, edit_rate, vocab)
            ).sum()
        )
        step = max(step, span / MAX_CELLS)
    k_lo, laws = _token_laws(excess, log_norm, edit_rate, vocab, step)
    units = np.ceil(llr / step).astype(np.int64)  # [m, D]
    block_scores = np.zeros((r, values_n))
    np.add.at(block_scores, rows, llr)
    block_units = np.zeros((r, values_n), dtype=np.int64)
    np.add.at(block_units, rows, units)
    block_laws = tuple(_convolve_laws([(int(k_lo[t]), laws[t]) for t in np.flatnonzero(rows == i)]) for i in range(r))
    return GumbelLikelihoodResult(
        params=params,
        temperature=float(temperature),
        text_length=int(n),
        scores=block_scores,
        units=block_units,
        row_counts=np.bincount(rows, minlength=r).astype(np.int64),
        positions=positions.astype(np.int64),
        rows=rows.astype(np.int64),
        llr=llr,
        step=step,
        block_laws=block_laws,
        edit_rate=float(edit_rate),
        salt=salt,
    )


def _log_mgf(law: tuple[int, FloatArray], lam: FloatArray) -> FloatArray:
    """log E exp(lam * X) for X with this law, at every lam (per unit)."""
    offset, pmf = law
    support = offset + np.arange(pmf.size)
    with np.errstate(divide="ignore"):
        logs = np.log(pmf)[None, :] + lam[:, None] * support[None, :]  # [L, S]
    top = logs.max(axis=1)
    out: FloatArray = top + np.log(np.exp(logs - top[:, None]).sum(axis=1))
    return out


def gumbel_likelihood_identity_p(result: GumbelLikelihoodResult, candidates: CandidateSet, best: int) -> float:
    """The identity test of candidate ``best`` against every other candidate c: the largest, over c,
    of P(sum over the blocks where c differs of the best's units >= observed) on a text c wrote."""
    values = candidates.blocks[best].astype(np.int64)
    r = values.size
    own = result.units[np.arange(r), values]  # [r] the best's units per block
    lam = _CHERNOFF_LAMBDAS * result.step  # per unit
    cumulant = np.stack([_log_mgf(law, lam) for law in result.block_laws])  # [r, L]
    # the bound and the exact tail depend only on the blocks where c differs: once per pattern
    differs, holders = difference_patterns(candidates.blocks, candidates.blocks[best])  # [P, r], [P]
    if not len(holders):
        return 0.0
    observed = differs @ own  # [P]
    log_mgf = differs.astype(np.float64) @ cumulant  # [P, L]
    bound = np.exp(np.minimum(0.0, (log_mgf - lam[None, :] * observed[:, None]).min(axis=1)))
    keep = MAX_EXACT_RIVALS + 1
    largest = np.argpartition(-bound, keep - 1)[:keep] if bound.size > keep else np.arange(bound.size)
    unsettled = [(float(bound[i]), int(holders[i])) for i in largest]

    def exact(index: int) -> float:
        differs = candidates.blocks[index].astype(np.int64) != values
        return result.tail(int(own[differs].sum()), np.flatnonzero(differs).tolist())

    return largest_exact_p(unsettled, exact, MAX_EXACT_RIVALS)


def attribute_gumbel_likelihood(
    result: GumbelLikelihoodResult,
    candidates: CandidateSet,
    *,
    top: int = 5,
    alpha: float = DEFAULT_ALPHA,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    multiplicity: Multiplicity | None = None,
    identity_level: float | None = None,
    rule: NamingRule | None = None,
) -> LikelihoodAttribution:
    """Score every registered message; name the best only if its p-value, corrected for the
    registry size and ``multiplicity``'s other tests, is below ``alpha``, its posterior (softmax of the LLRs) at least
    ``min_confidence``, and its identity test against every other registered message at most
    ``alpha`` (or ``identity_level`` where that is stricter), as the counting ``gumbel`` decoder.
    With salts, every p-value also counts the S salts the reading chose among (``Multiplicity.salt_factor``)."""
    rule = rule_of(rule, alpha, min_confidence, identity_level)
    multiplicity = check_ranking(top, multiplicity)
    params = result.params
    if candidates.params.bits != params.bits or candidates.params.block_bits != params.block_bits:
        raise ParamsError("candidate messages do not match the decoder's message length")
    count = len(candidates)
    if count == 0 or result.scored_tokens == 0:
        return LikelihoodAttribution([], None, 1.0, 0.0, 0.0, 0, bound=BOUND)
    totals = candidates.hits(result.scores)  # float64 [C]: L(m)
    order, confidence, margin = rank_by_likelihood(totals, top)
    picked = candidates.blocks[order].astype(np.int64)  # [k, r]
    observed_all = result.units[np.arange(picked.shape[1])[None, :], picked].sum(axis=1)  # [k]
    raw = np.maximum(_tails(result.block_laws, observed_all), P_FLOOR)
    decoded = result.blocks
    factors = multiplicity.naming_factors(candidates, order, params)
    out = []
    p_best, statistic = 1.0, 0
    for rank, idx in enumerate(order):
        cand_blocks = picked[rank]
        observed = int(observed_all[rank])
        p_value = min(1.0, float(raw[rank]) * float(factors[rank]))
        if rank == 0:
            p_best, statistic = p_value, observed
        hamming = _hamming_blocks(cand_blocks, decoded, params)
        out.append(
            CandidateScore(candidates.ids[idx], candidates.bits_of(int(idx)), float(totals[idx]), p_value, hamming)
        )
    named = rule.evidence_names(p_best, margin, confidence, lone=count == 1)
    identity = None
    level = rule.identity_bound(always=True)
    if named and count > 1 and level is not None:
        identity = gumbel_likelihood_identity_p(result, candidates, int(order[0]))
        named = identity <= level
    return LikelihoodAttribution(
        out, out[0] if named else None, p_best, confidence, margin, statistic, bound=BOUND, identity_p_value=identity
    )
