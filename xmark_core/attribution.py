"""Registry-aware attribution: which registered message explains the cTMM best, and how surely.

For a fixed candidate message m, H_m = sum_i A[i, m_i] counts the trials that hit m's cells.
On unwatermarked text H_m ~ Binomial(trials, q0) exactly (see ``null``); text watermarked with m
makes H_m small (large for MPAC). Candidates are ranked by H_m, which is equivalent to ranking
by the log-likelihood ratio against the null with a common per-trial rate q1; the score reported
is that LLR (nats) with q1 fitted to the best candidate. Calibration:

* ``p_value``: probability that the best of C candidates scores this well on unwatermarked text,
  bounded by C * P(Binomial(trials, q0) <= H_best) (Bonferroni; exact per candidate).
* ``confidence``: posterior probability of the best candidate among all candidates under the fitted
  model with a uniform prior -- how sure we are it is this user and not another one.
* ``margin``: LLR of the best minus LLR of the runner-up (nats).

The best candidate is *named* only when p_value < alpha and confidence >= min_confidence (0.99
by default). The fitted model under-states how much a wrong block costs a candidate (it scores
other cells at the null rate, while under the watermark they are boosted), so the posterior is
conservative. On a synthetic LM with 10,000 allocated 16-bit IDs and 150-token texts, naming at
p < 1e-3 alone named 2 wrong users of 48; with the confidence rule none of 34 named was wrong.

Because the best candidate is chosen by H_m rather than by exact bit agreement, a user is still
named when a few blocks decode wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import gumbel
from .decoder import DecodeResult, null_inclusion_probability
from .errors import ArgumentError, ParamsError
from .message import bits_to_blocks
from .naming import DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, Multiplicity, NamingRule, check_ranking, corrected, rule_of
from .null import binomial_log_cdf, binomial_log_pmf
from .params import WatermarkParams


class CandidateSet:
    """Registered messages, packed for scoring: two blocks per code (a byte while D**2 <= 256, two
    bytes up to D = 256, the largest block a ``gumbel`` key has)."""

    def __init__(self, bits: Sequence[str], ids: Sequence[object], params: WatermarkParams) -> None:
        if len(bits) != len(ids):
            raise ArgumentError(f"got {len(bits)} messages but {len(ids)} ids")
        self._pack(bits_to_blocks(list(bits), params).astype(np.uint8), list(ids), params)  # blocks [C, r]

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, ids: Sequence[object], params: WatermarkParams) -> CandidateSet:
        """Candidates from their block values already computed (``bits_to_blocks``, uint8 [C, r]):
        a registry read in slices packs each slice as it comes."""
        if len(blocks) != len(ids):
            raise ArgumentError(f"got {len(blocks)} messages but {len(ids)} ids")
        made = cls.__new__(cls)
        made._pack(np.asarray(blocks, dtype=np.uint8).reshape(len(ids), params.num_blocks), list(ids), params)
        return made

    def _pack(self, blocks: np.ndarray, ids: list[object], params: WatermarkParams) -> None:
        self.params = params
        self.ids = ids
        self.blocks = blocks  # uint8 [C, r]
        shards = params.num_shards
        r = params.num_blocks
        pairs = r // 2
        code = np.uint8 if shards * shards <= 256 else np.uint16
        self._pair_codes = [
            (blocks[:, 2 * q].astype(np.uint32) * shards + blocks[:, 2 * q + 1]).astype(code) for q in range(pairs)
        ]  # each [C], code = v_{2q} * D + v_{2q+1}
        self._single = blocks[:, r - 1].copy() if r % 2 else None
        # each candidate's share of the level (``with_shares``); None: an equal share each
        self.shares: np.ndarray | None = None

    def subset(self, indices: Sequence[int]) -> CandidateSet:
        """The candidates at ``indices``, in that order (e.g. the users a content search led to)."""
        chosen = np.asarray(indices, dtype=np.int64)  # [C']
        subset = CandidateSet.__new__(CandidateSet)
        subset._pack(
            self.blocks[chosen].reshape(len(chosen), self.params.num_blocks),
            [self.ids[i] for i in indices],
            self.params,
        )
        return subset

    def extended(self, bits: Sequence[str], ids: Sequence[object]) -> CandidateSet:
        """These candidates followed by ``ids`` (with messages ``bits``): a registry that grew."""
        if len(bits) != len(ids):
            raise ArgumentError(f"got {len(bits)} messages but {len(ids)} ids")
        if not ids:
            return self
        added = bits_to_blocks(list(bits), self.params).astype(np.uint8)
        grown = CandidateSet.__new__(CandidateSet)
        grown._pack(
            np.concatenate([self.blocks, added.reshape(len(ids), self.params.num_blocks)]),
            [*self.ids, *ids],
            self.params,
        )
        return grown

    def with_shares(self, shares: Sequence[float]) -> CandidateSet:
        """These candidates, each given its share of the level (weighted Bonferroni): candidate c's
        p-value is its tail over ``shares[c]`` (times the other tests) rather than times ``len(self)``.
        Naming any wrong candidate then has probability at most ``alpha * sum(shares)``, so the
        shares must be positive, sum to at most 1, and be fixed before the text's watermark is
        read (e.g. by a content search's ranking). ``subset`` and ``extended`` drop them."""
        weights = np.asarray(shares, dtype=np.float64)
        if weights.shape != (len(self),):
            raise ArgumentError(f"got {weights.size} shares for {len(self)} candidates")
        if len(self) and (not np.all(weights > 0) or weights.sum() > 1.0 + 1e-9):
            raise ArgumentError("shares must be positive and sum to at most 1")
        shared = CandidateSet.__new__(CandidateSet)
        shared._pack(self.blocks, self.ids, self.params)
        shared.shares = weights
        return shared

    def multiplicity(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """[len(indices)] float64: the factor each of these candidates' p-values is multiplied by
        for the candidate set's size (``len(self)``, or one over the candidate's share)."""
        chosen = np.asarray(indices, dtype=np.int64)
        if self.shares is None:
            return np.full(chosen.shape, float(len(self)))
        return np.asarray(1.0 / self.shares[chosen], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.ids)

    def bits_of(self, index: int) -> str:
        d = self.params.block_bits
        return "".join(format(int(v), f"0{d}b") for v in self.blocks[index])

    def hits(self, matrix: np.ndarray) -> np.ndarray:
        """[C]: sum_i matrix[i, m_i] for every candidate m (``matrix`` [r, D]: int64 counts give
        H_m, int32 where D <= 4 and no sum can pass it; float64 block scores give the likelihood
        decoder's L(m))."""
        if matrix.dtype.kind in "iu" and self.params.num_shards <= 4:
            return self._integer_hits(matrix)
        return self._pair_hits(matrix)

    def _pair_hits(self, matrix: np.ndarray) -> np.ndarray:
        """``hits`` two blocks a lookup, in ``matrix``'s type widened to 64 bits: the float64 block
        scores' order of additions, which every likelihood reading was measured with."""
        total = np.zeros(len(self.ids), dtype=np.result_type(matrix.dtype, np.int64))
        for q, codes in enumerate(self._pair_codes):
            table = (matrix[2 * q][:, None] + matrix[2 * q + 1][None, :]).ravel()  # [D*D]
            total += table[codes]
        if self._single is not None:
            total += matrix[-1][self._single]
        return total

    def _integer_hits(self, matrix: np.ndarray) -> np.ndarray:
        """``hits`` of integer counts where D <= 4: four blocks a lookup (their code, below 256, made
        from two pair codes as it is read), summed in 32 bits where no candidate can reach 2**31.
        Half the passes over the candidates of the pairs' way, each on narrower numbers: over 10^7
        64-bit IDs of 2-bit blocks 2.19 times faster (``python -m benchmarks.hits_bench``);
        exact, as integers are."""
        counts = np.asarray(matrix, dtype=np.int64)
        wide = int(np.abs(counts).sum()) >= 2**31  # a candidate's sum could pass int32
        dtype: type[np.signedinteger[Any]] = np.int64 if wide else np.int32
        shift = 2 * self.params.block_bits  # a pair's code is below 2**shift
        pairs = [(counts[2 * q][:, None] + counts[2 * q + 1][None, :]).ravel() for q in range(len(self._pair_codes))]
        total: np.ndarray[tuple[int], np.dtype[np.signedinteger[Any]]] = np.zeros(len(self.ids), dtype=dtype)
        code = np.empty(len(self.ids), dtype=np.uint8)
        for q in range(len(pairs) // 2):
            table = (pairs[2 * q][:, None] + pairs[2 * q + 1][None, :]).ravel().astype(dtype)
            np.left_shift(self._pair_codes[2 * q], shift, out=code)
            np.bitwise_or(code, self._pair_codes[2 * q + 1], out=code)
            total += table[code]
        if len(pairs) % 2:
            total += pairs[-1].astype(dtype)[self._pair_codes[-1]]
        if self._single is not None:
            total += counts[-1].astype(dtype)[self._single]
        return total


_TOP_SCAN = 1 << 16  # registries above this find their top candidates among a prefiltered few
_TOP_STRIDE = 4096


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """int64 [min(k, C)]: the indices of the ``k`` largest of ``values`` ([C]), largest first (ties
    in index order). Past 65,536 values the search reads the maxima of slices of 4,096 first: the
    k-th largest of those is at most the k-th largest value, so only the values at or above it
    (a few dozen in a registry of 10^7, not all of them) are ranked."""
    count = values.size
    k = min(k, count)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    pool: np.ndarray | None = None
    slices = count // _TOP_STRIDE
    if count > _TOP_SCAN and slices >= k:
        maxima = values[: slices * _TOP_STRIDE].reshape(slices, _TOP_STRIDE).max(axis=1)
        floor = np.partition(maxima, slices - k)[slices - k]
        pool = np.flatnonzero(values >= floor)  # every value ranked in the top k is here
    if pool is None:
        pool = np.arange(count, dtype=np.int64)
    if k < pool.size:  # the k-th largest; of the values equal to it, the first in index order
        kept = values[pool]
        kth = np.partition(kept, pool.size - k)[pool.size - k]
        above = pool[kept > kth]
        pool = np.concatenate([above, pool[kept == kth][: k - above.size]])
    return pool[np.lexsort((pool, -values[pool]))].astype(np.int64)


def best_posterior(scores: np.ndarray, best: int) -> float:
    """The softmax of ``scores`` at ``best`` (one exponential per candidate)."""
    weights = np.exp(scores - scores.max())
    return float(weights[best] / weights.sum())


@dataclass(frozen=True)
class CandidateScore:
    id: object
    bits: str
    score: float
    p_value: float
    hamming: int


@dataclass(frozen=True)
class Attribution:
    candidates: list[CandidateScore]
    best: CandidateScore | None
    p_value: float
    confidence: float
    margin: float
    # the identity test's p-value for the best candidate (``attribute(..., identity_level=...)``);
    # None where it did not run
    identity_p_value: float | None = None


def attribute(
    result: DecodeResult,
    candidates: CandidateSet,
    *,
    top: int = 5,
    alpha: float = DEFAULT_ALPHA,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    multiplicity: Multiplicity | None = None,
    identity_level: float | None = None,
    rule: NamingRule | None = None,
) -> Attribution:
    """Score every candidate against the decoded matrix.

    ``multiplicity``: the other tests run on the same text (key versions, encoders, decoders,
    candidate sets; None: this test alone): each candidate's p-value is corrected for them, for
    the ``len(candidates)`` candidates (or the candidate's share) and for the salts
    (``Multiplicity.naming_factors``).

    The best candidate is named (``best``) only if the text is unlikely to be unwatermarked
    (``p_value < alpha``) AND the best is much likelier than every other registered ID
    (``confidence >= min_confidence``): in a dense registry neighbouring IDs differ in one or two
    blocks, and a short text can fit a neighbour almost as well as the author.

    ``identity_level``: also require :func:`counting_identity_p` against every other candidate at
    most this (a wrong registered user is then named with probability at most ``identity_level``,
    edited text included); needs a cTMM reading or k = 1. The ``gumbel`` scheme always runs its own
    identity test (:func:`gumbel_identity_p`), at ``alpha`` or at this level where it is stricter.
    """
    rule = rule_of(rule, alpha, min_confidence, identity_level)
    distortion_free = result.params.distortion_free
    if identity_level is not None and not distortion_free and not result.constrained and result.params.num_keys > 1:
        raise ArgumentError("identity_level needs a cTMM reading (decode(..., constrained=True)) or k = 1")
    params = result.params
    if candidates.params.bits != params.bits or candidates.params.block_bits != params.block_bits:
        raise ParamsError("candidate messages do not match the decoder's message length")
    multiplicity = check_ranking(top, multiplicity)
    count = len(candidates)
    trials = result.trials
    if count == 0 or trials == 0:
        return Attribution([], None, 1.0, 0.0, 0.0)
    if distortion_free:
        return _attribute_gumbel(result, candidates, top=top, rule=rule, multiplicity=multiplicity)
    upper = params.scheme == "mpac"
    q0 = null_inclusion_probability(params, result.constrained)
    hits = candidates.hits(result.matrix)  # [C]
    keyed = -hits if upper else hits  # smaller = better
    k = min(top, count)
    order = top_indices(-keyed, k)
    best_hits = int(hits[order[0]])
    q1 = min(max(best_hits / trials, 1e-9), 1 - 1e-9)
    if (q1 < q0) != upper and q1 != q0:
        lam = np.log(q1 / q0) - np.log((1 - q1) / (1 - q0))  # LLR per hit
        base = trials * np.log((1 - q1) / (1 - q0))
    else:
        lam, base = 0.0, 0.0
    scores_all = base + lam * hits.astype(np.float64)  # LLR of every candidate, nats
    log_tail = binomial_log_cdf(hits[order], trials, q0, upper=upper)
    p_values = corrected(np.exp(log_tail), multiplicity.naming_factors(candidates, order, params))
    decoded = result.blocks
    out = []
    for rank, idx in enumerate(order):
        bits = candidates.bits_of(int(idx))
        cand_blocks = candidates.blocks[idx].astype(np.int64)
        hamming = _hamming_blocks(cand_blocks, decoded, params)
        out.append(CandidateScore(candidates.ids[idx], bits, float(scores_all[idx]), float(p_values[rank]), hamming))
    best_score = float(scores_all[order[0]])
    if count > 1:
        runner_up = float(scores_all[order[1]]) if k > 1 else float(np.partition(scores_all, count - 2)[count - 2])
        margin = best_score - runner_up
    else:
        margin = best_score
    p_best = float(p_values[0])
    confidence = best_posterior(scores_all, int(order[0]))
    named = rule.evidence_names(p_best, margin, confidence, lone=count == 1)
    identity = None
    level = rule.identity_bound(always=False)
    if named and level is not None:  # the best explains the text; does no other user?
        identity = counting_identity_p(result, candidates, int(order[0]))
        named = identity is not None and identity <= level
    return Attribution(out, out[0] if named else None, p_best, confidence, margin, identity)


def _attribute_gumbel(
    result: DecodeResult,
    candidates: CandidateSet,
    *,
    top: int,
    rule: NamingRule,
    multiplicity: Multiplicity,
) -> Attribution:
    """:func:`attribute` for the ``gumbel`` scheme: a candidate's score S_m = sum_i M[i, m_i] is
    Gamma(n, 1) on unwatermarked text (n scored tokens), its p-value the exact Gamma tail (Bonferroni
    over candidates and the multiplicity); the reported score is the LLR of an Exp(rate) model of the message
    cells against Exp(1), the rate fitted to the best candidate (rate = n / S_best). The best is
    named when, besides the rule of :func:`attribute`, its identity test against every other
    candidate (:func:`gumbel_identity_p`) is at most ``rule.identity_bound(always=True)`` (``alpha``,
    or the caller's stricter level). With salts, the matrix is the read salt's and every p-value counts all S salts
    (Bonferroni: some salt's best candidate scoring this well on unwatermarked text)."""
    count, tokens = len(candidates), result.scored_tokens
    totals = candidates.hits(result.matrix)  # float64 [C]
    k = min(top, count)
    order = top_indices(totals, k)
    best = float(totals[order[0]])
    weight = 1.0 - tokens / best if best > tokens else 0.0  # 1 - fitted rate
    base = tokens * np.log(1.0 - weight) if weight > 0 else 0.0
    scores_all = base + weight * totals  # LLR of every candidate, nats
    log_tail = gumbel.gamma_log_sf(totals[order], tokens)
    p_values = corrected(np.exp(log_tail), multiplicity.naming_factors(candidates, order, result.params))
    out = []
    for rank, idx in enumerate(order):
        cand_blocks = candidates.blocks[idx].astype(np.int64)
        hamming = _hamming_blocks(cand_blocks, result.blocks, result.params)
        out.append(
            CandidateScore(
                candidates.ids[idx],
                candidates.bits_of(int(idx)),
                float(scores_all[idx]),
                float(p_values[rank]),
                hamming,
            )
        )
    if count > 1:
        runner_up = float(scores_all[order[1]]) if k > 1 else float(np.partition(scores_all, count - 2)[count - 2])
        margin = float(scores_all[order[0]]) - runner_up
    else:
        margin = float(scores_all[order[0]])
    p_best, confidence = float(p_values[0]), best_posterior(scores_all, int(order[0]))
    named = rule.evidence_names(p_best, margin, confidence, lone=count == 1)
    identity = None
    level = rule.identity_bound(always=True)
    if named and count > 1 and level is not None:
        identity = gumbel_identity_p(result, candidates, int(order[0]))
        named = identity <= level
    return Attribution(out, out[0] if named else None, p_best, confidence, margin, identity)


def gumbel_identity_p(result: DecodeResult, candidates: CandidateSet, best: int) -> float:
    """The ``gumbel`` scheme's identity test of candidate ``best`` against every other candidate c:
    the largest, over c, of P(Gamma(n_c, 1) >= S_c), S_c being the best candidate's score over the
    blocks where its message differs from c's and n_c the scored tokens in them. If c wrote the
    text, the best candidate's values in those blocks are not c's, so their draws are independent
    of the text: S_c is Gamma(n_c, 1) exactly and a small p-value rejects c. A candidate that
    differs from the best only in blocks with no scored token cannot be told apart (p = 1). Exact
    for each alternative; the choice of the best candidate is not corrected for. S_c and n_c depend
    only on which blocks differ, so each distinct pattern of them is tested once
    (:func:`difference_patterns`: at most 2^r, however large the registry)."""
    matrix = result.matrix
    values = candidates.blocks[best].astype(np.int64)  # [r]
    own = matrix[np.arange(matrix.shape[0]), values]  # [r] the best candidate's cell of each block
    patterns, _ = difference_patterns(candidates.blocks, candidates.blocks[best])
    if not len(patterns):  # the best is the only candidate
        return 0.0
    tokens = patterns @ result.row_counts  # [P]
    score = patterns @ own  # [P]
    return float(np.exp(gumbel.gamma_log_sf_each(score, tokens)).max())


_PATTERN_CHUNK = 1 << 20
_PATTERN_TABLE_BLOCKS = 20  # up to 2^20 patterns: one table slot each


def difference_patterns(blocks: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct patterns of blocks in which the candidates (``blocks``, [C, r]) differ from
    ``target`` ([r]): bool [P, r], the pattern of no difference left out, and one candidate with
    each pattern (int64 [P]). An identity test whose statistic depends only on the differing blocks
    (the ``gumbel`` scheme's) runs once per pattern instead of once per candidate: at most 2^r
    patterns (16 for a 32-bit message in 8-bit blocks) among 10^7 registered IDs."""
    r = blocks.shape[1]
    if r <= _PATTERN_TABLE_BLOCKS:
        weights = np.left_shift(np.int64(1), np.arange(r, dtype=np.int64))  # [r]
        holder = np.full(1 << r, -1, dtype=np.int64)  # a candidate with each pattern code, -1: none
        for first in range(0, len(blocks), _PATTERN_CHUNK):
            differs = blocks[first : first + _PATTERN_CHUNK] != target[None, :]  # [c, r]
            codes = differs @ weights  # [c]
            holder[codes] = np.arange(first, first + codes.size, dtype=np.int64)  # any holder will do
        holder[0] = -1  # no difference: the target's own row (and copies of it)
        chosen = holder[holder >= 0]
    else:
        found: dict[bytes, int] = {}
        for first in range(0, len(blocks), _PATTERN_CHUNK):
            differs = blocks[first : first + _PATTERN_CHUNK] != target[None, :]
            packed = np.packbits(differs, axis=1)
            rows, index = np.unique(packed, axis=0, return_index=True)
            for row, i in zip(rows, index, strict=True):
                if row.any():
                    found.setdefault(row.tobytes(), first + int(i))
        chosen = np.fromiter(found.values(), dtype=np.int64, count=len(found))
    return blocks[chosen] != target[None, :], chosen


def rival_shares(params: WatermarkParams) -> tuple[float, float]:
    """(q_in, q_out): on a text that carries block value v' at a position, the probability that its
    token is in E_v for another value v, given that it is in E_v' (q_in) or not (q_out).

    The text was generated seeing only E_v' (a token's membership in it), and the keyed hash puts
    each token's k shards uniformly over the patterns consistent with that membership, whatever the
    model did. XMark / LoSo (E_v: every shard differs from v): in E_v' every shard is one of the
    D - 1 other values, so q_in = ((D - 2) / (D - 1))^k; out of it, among the D^k - (D - 1)^k
    patterns with a shard equal to v', (D - 1)^k - (D - 2)^k avoid v. MPAC (E_v: the shard is v):
    q_in = 0, q_out = 1 / (D - 1).
    """
    shards, k = params.num_shards, params.num_keys
    if params.scheme == "mpac":
        return 0.0, 1.0 / (shards - 1)
    q_in = ((shards - 2) / (shards - 1)) ** k
    q_out = ((shards - 1) ** k - (shards - 2) ** k) / (shards**k - (shards - 1) ** k)
    return q_in, q_out


_CHERNOFF_LAMBDAS = np.geomspace(0.01, 12.0, 40)  # the Chernoff bound's exponents, per token
MAX_EXACT_RIVALS = 64
_RIVAL_CHUNK = 65_536


def counting_identity_p(result: DecodeResult, candidates: CandidateSet, best: int) -> float | None:
    """The counting decoder's identity test of candidate ``best`` against every other candidate c:
    the largest, over c, of the exact p-value of "the text carries c" (None: the test needs one trial
    per token, a cTMM or k = 1).

    Over the blocks where c differs from the best, S counts the tokens outside E_best (XMark, LoSo:
    a token with a shard equal to the best's value; MPAC: inside it). If c wrote the text, its
    generation saw only each token's membership in E_c, which the matrix gives per block (the cell
    of c's value), and the keyed hash puts a token's shards uniformly over the patterns consistent
    with that membership (:func:`rival_shares`): given those counts, S is a sum of two binomials,
    Binomial(N_in, 1 - q_in) + Binomial(N_out, 1 - q_out) (MPAC: Binomial(N_out, q_out) counted from
    above), exactly, whatever the model did. That holds for tokens an editor put in or moved too:
    their shards are the hash's alone. A wrong name needs the author's own test to reject, so
    naming only when this is at most beta names a wrong registered user with probability at most
    beta, with no correction for the registry's size.

    Every rival is bounded by Chernoff first (vectorised over the registry); the at most
    ``MAX_EXACT_RIVALS`` rivals the bound leaves above the largest exact p-value so far are tested
    exactly (past them the bound stands).
    """
    params = result.params
    if not result.constrained and params.num_keys > 1:
        return None
    if len(candidates) < 2:
        return 0.0
    matrix = result.matrix.astype(np.int64)  # [r, D]
    rows = np.arange(matrix.shape[0])
    values = candidates.blocks[best].astype(np.int64)  # [r]
    own = matrix[rows, values]  # [r] the best's cell of each block
    counts = result.row_counts.astype(np.int64)  # [r]
    q_in, q_out = rival_shares(params)
    mpac = params.scheme == "mpac"
    # per block and rival value: tokens inside E_c (N_in) and their chance of counting in S
    inside = matrix if mpac else counts[:, None] - matrix  # [r, D]
    p_in, p_out = (q_in, q_out) if mpac else (1.0 - q_in, 1.0 - q_out)
    lam = _CHERNOFF_LAMBDAS if mpac else -_CHERNOFF_LAMBDAS  # [L]: e^{lam S}, upper or lower tail
    log_in = np.log1p(p_in * np.expm1(lam))  # [L] per token inside E_c
    log_out = np.log1p(p_out * np.expm1(lam))  # [L] per token outside
    unsettled: list[tuple[float, int]] = []
    for first in range(0, len(candidates), _RIVAL_CHUNK):
        part = candidates.blocks[first : first + _RIVAL_CHUNK].astype(np.int64)  # [c, r]
        differs = part != values[None, :]  # [c, r]
        n_in = (differs * inside[rows[None, :], part]).sum(axis=1)  # [c]
        n_all = differs @ counts  # [c]
        observed = differs @ own  # [c]
        exponent = n_in[:, None] * log_in + (n_all - n_in)[:, None] * log_out - lam * observed[:, None]  # [c, L]
        bound = np.exp(np.minimum(0.0, exponent.min(axis=1)))  # [c]
        bound[~differs.any(axis=1)] = -1.0  # the best itself
        keep = min(bound.size, MAX_EXACT_RIVALS + 1)
        largest = np.argpartition(-bound, keep - 1)[:keep]
        unsettled.extend((float(bound[i]), first + int(i)) for i in largest if bound[i] >= 0.0)

    def exact(index: int) -> float:
        differs = candidates.blocks[index].astype(np.int64) != values
        n_in = int(inside[rows[differs], candidates.blocks[index][differs].astype(np.int64)].sum())
        n_all = int(counts[differs].sum())
        return _two_binomial_tail(n_in, p_in, n_all - n_in, p_out, int(own[differs].sum()), upper=mpac)

    return largest_exact_p(unsettled, exact, MAX_EXACT_RIVALS)


def largest_exact_p(unsettled: list[tuple[float, int]], exact: Callable[[int], float], limit: int) -> float:
    """The largest p-value over rivals screened by an upper bound: ``unsettled`` holds (bound,
    rival) pairs, ``exact(rival)`` the rival's exact p-value. Rivals are tested in decreasing order
    of their bound until a bound falls to the largest exact p-value so far; past ``limit`` exact
    tests the next bound stands for the rest."""
    worst = 0.0
    for rank, (bound_value, index) in enumerate(sorted(unsettled, reverse=True)):
        if bound_value <= worst:
            break
        if rank >= limit:
            return max(worst, bound_value)  # not settled exactly: the bound stands
        worst = max(worst, min(exact(index), bound_value))
    return worst


def _two_binomial_tail(n1: int, p1: float, n2: int, p2: float, observed: int, *, upper: bool) -> float:
    """P(X + Y <= observed) (``upper``: >=), X ~ Binomial(n1, p1), Y ~ Binomial(n2, p2), exactly."""

    def pmf(n: int, p: float) -> np.ndarray:
        if p <= 0.0 or n == 0:
            out = np.zeros(n + 1)
            out[0] = 1.0
            return out
        if p >= 1.0:
            out = np.zeros(n + 1)
            out[n] = 1.0
            return out
        exact: np.ndarray = np.exp(binomial_log_pmf(n, p))
        return exact

    total = np.convolve(pmf(n1, p1), pmf(n2, p2))  # [n1 + n2 + 1]
    tail = total[observed:].sum() if upper else total[: observed + 1].sum()
    return float(min(1.0, tail))


def _hamming_blocks(candidate: np.ndarray, decoded: np.ndarray, params: WatermarkParams) -> int:
    """Bit distance between a candidate and the decoded blocks (erased blocks count as all wrong)."""
    d = params.block_bits
    diff = np.where(decoded < 0, (1 << d) - 1, candidate ^ np.maximum(decoded, 0))
    return int(np.bitwise_count(diff.astype(np.uint64)).sum())
