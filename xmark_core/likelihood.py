"""The likelihood decoder: score a suspect text with the model's own next-token distribution.

The counting decoder gives every scored token the same weight. A token the model was sure of
(a word's second half, a closing bracket) says nothing about the watermark, because the bias
could not have changed it; a token chosen among many says a lot. Given the model's next-token
distribution at every position (its top-K log-probabilities and the text's own token), this
decoder weighs each token by how much the watermark could have moved it.

For a scored position t with context (x[t-2], x[t-1]), block i_t = (x[t-2] + x[t-1]) mod r and a
candidate block value v, let E_v be the boosted list (the evergreen list of the XMark scheme; the
green shard for MPAC), B_t(v) = 1[x_t in E_v], p the model's distribution at temperature tau,
a = delta / tau, and P^-(v) = p's mass on E_v *without x_t itself*. Whether x_t is in E_v, given
that x_t was generated, has the likelihood ratio

    LR_t(v) = e^a (1 + (e^a - 1) P^-(v)) / (1 + (e^a - 1) (P^-(v) + p(x_t)))     (in [1, e^a])

between "the text carries v here" and "it does not": 1 when the model was certain of x_t, e^a
when x_t had little probability. The evidence of the position for v is the log-likelihood ratio
of B_t(v) under the watermark against the null below:

    llr_t(v) = B_t(v) log LR_t(v) - log(gamma LR_t(v) + 1 - gamma)

where gamma = P(B_t(v) = 1) on text that does not carry this key's watermark: the keyed hash
puts every (context, token) into E_v with probability gamma = (1 - 1/D)^k (XMark, LoSo with
k = 1) or 1/D (MPAC), independently of every other token's membership. Because LR_t(v) uses only
the *other* tokens' memberships and p(x_t), it is independent of B_t(v) under that null, for any
text: sampled from this model, from another one, or written by a person. A context that occurs
twice with different next tokens would break that across positions (each token is "another
token" of the other position), so such tokens enter P^- at their expected membership gamma: every
weight is then independent of every scored membership. That is what makes the
p-value below valid without assuming the text came from the scoring model, and why the temperature
tau (and the top-K approximation of P^-) changes only the power, never the calibration.

With the entropy rule on (``WatermarkParams.min_entropy`` h > 0), the encoder biased only the
positions where the model's min-entropy -log max_x p(x) (temperature 1) was at least h: there
LR_t = 1, so a position whose top log-probability is above -h gets weight 0. That depends on the
model's distribution alone, so the independence above holds unchanged. The scoring pass need not
see the distribution the encoder saw (it reads the text without its prompt): a position judged
differently costs power only.

A suspect text is often edited: a token put in by a person or a tool was never drawn from p, and
a token the model would not have written (p(x_t) tiny) gets the largest weight above. With an
edit rate eps, x_t is generated with probability 1 - eps and otherwise any of the V tokens:

    LR_t(v) = [(1 - eps) p(x_t) e^a / (1 + (e^a - 1)(P^-(v) + p(x_t))) + eps / V]
            / [(1 - eps) p(x_t)     / (1 + (e^a - 1) P^-(v))            + eps / V]

which is the ratio above where p(x_t) >> eps / V and tends to 1 (no evidence) where the model
gives x_t less than an edit would. It still depends only on p(x_t) and P^-(v), so everything below
holds for any eps.

Block scores S[i, v] = sum of llr_t(v) over the positions of block i; a registered message m
scores L(m) = sum_i S[i, m_i], its log-likelihood ratio; the posterior over the registry is the
softmax of L. The naming test for the best candidate m* uses U = sum_t u_t B_t(m*_{i_t}) with
integer weights u_t = ceil(log LR_t / h) (the LLR's weights on a grid of step h): under the null
the B_t are independent Bernoulli(gamma), so U's distribution is computed exactly (a convolution)
and p = P(U >= U_observed) is exact for that statistic. It is corrected for the registry size and
the key versions tried (Bonferroni). Repeated (x[t-2], x[t-1], x[t]) triples are scored once, and
the first two tokens are context only, as in the counting decoder.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .attribution import (
    CandidateScore,
    CandidateSet,
    _hamming_blocks,
    largest_exact_p,
    rival_shares,
    top_indices,
)
from .decoder import MAX_TOKEN_ID, _first_occurrences
from .errors import ArgumentError, DecodeInputError, ParamsError
from .hashing import block_index, context_multipliers, shard, shard_of, token_codes
from .keys import WatermarkKey
from .naming import DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, Multiplicity, NamingRule, check_ranking, rule_of
from .params import WatermarkParams

DEFAULT_TOP_K = 20
DEFAULT_TEMPERATURE = 0.7
# share of a suspect text's tokens assumed to come from edits (substitutions, insertions) rather
# than from the model: such a token weighs nothing where the model would not have written it
DEFAULT_EDIT_RATE = 0.01
# grid steps per nat of the integer weights of the exact naming test
WEIGHT_STEPS_PER_NAT = 32
# the exact test's distribution has at most this many cells; longer texts use a coarser grid
MAX_TEST_CELLS = 1 << 20

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class ModelScores:
    """The model's next-token distribution at every position of a text, at temperature 1.

    Row t describes the distribution that predicted token t from the tokens before it (row 0,
    with nothing before it, is ignored).
    token_logprobs: float64 [n] log p(x_t | x_<t) of the text's own token;
    top_ids: int64 [n, K] the K likeliest tokens; top_logprobs: float64 [n, K] their log-probs;
    vocab_size: the model's vocabulary size (the tokens beyond the top K share the rest).
    """

    token_logprobs: FloatArray
    top_ids: IntArray
    top_logprobs: FloatArray
    vocab_size: int

    def __post_init__(self) -> None:
        n = self.token_logprobs.shape[0]
        if self.top_ids.ndim != 2 or self.top_ids.shape != self.top_logprobs.shape or self.top_ids.shape[0] != n:
            raise DecodeInputError(
                f"model scores disagree in shape: token_logprobs {self.token_logprobs.shape}, "
                f"top_ids {self.top_ids.shape}, top_logprobs {self.top_logprobs.shape}"
            )
        if self.vocab_size <= self.top_ids.shape[1]:
            raise DecodeInputError("vocab_size must be larger than the number of top tokens")

    def top(self, k: int) -> ModelScores:
        """The same scores with only the ``k`` likeliest tokens per position (columns sorted descending)."""
        return ModelScores(self.token_logprobs, self.top_ids[:, :k], self.top_logprobs[:, :k], self.vocab_size)

    def prefix(self, n: int) -> ModelScores:
        """The scores of the text's first ``n`` tokens (a causal model's scores of a prefix)."""
        return ModelScores(self.token_logprobs[:n], self.top_ids[:n], self.top_logprobs[:n], self.vocab_size)


def boosted_share(params: WatermarkParams) -> float:
    """gamma: the probability that a token is in a given block value's boosted list, by the hash alone."""
    shards = params.num_shards
    if params.scheme == "mpac":
        return 1.0 / shards
    return (1.0 - 1.0 / shards) ** params.num_keys


def _boosted(shards: IntArray, params: WatermarkParams) -> BoolArray:
    """bool [..., D]: whether a token with these k shards ([..., k]) is boosted for each block value."""
    values = np.arange(params.num_shards, dtype=np.int64)  # [D]
    # MPAC: key 0's shard equals the value; XMark and LoSo: no key's shard is the value
    mpac = params.scheme == "mpac"
    out: BoolArray = shards[..., :1] == values if mpac else (shards[..., :, None] != values).all(axis=-2)
    return out  # [..., D]


class BlockScores:
    """What every likelihood reading of a text gives: block scores S[i, v] (float64 [r, D]), the
    scored tokens per block and the positions scored."""

    params: WatermarkParams
    scores: FloatArray
    row_counts: IntArray
    positions: IntArray

    @property
    def scored_tokens(self) -> int:
        return int(self.positions.size)

    @property
    def blocks(self) -> IntArray:
        """int64 [r]: the likeliest value of each block (-1 where no token was scored)."""
        values: IntArray = self.scores.argmax(axis=1)
        values[self.row_counts == 0] = -1
        return values

    @property
    def bits(self) -> str:
        d = self.params.block_bits
        return "".join("?" * d if v < 0 else format(int(v), f"0{d}b") for v in self.blocks)

    @property
    def block_confidence(self) -> FloatArray:
        """float64 [r]: posterior of each block's likeliest value (uniform prior over the D values)."""
        shifted = self.scores - self.scores.max(axis=1, keepdims=True)
        posterior = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        out: FloatArray = posterior.max(axis=1)
        out[self.row_counts == 0] = 0.0
        return out


def rank_by_likelihood(totals: FloatArray, top: int) -> tuple[IntArray, float, float]:
    """The ``top`` candidates by log-likelihood ratio L (descending), the best's posterior (softmax
    of L over all candidates) and its margin in L over the runner-up."""
    count = totals.size
    k = min(top, count)
    order = top_indices(totals, k)
    shifted = totals - totals[order[0]]
    confidence = float(1.0 / np.exp(shifted).sum())
    if count > 1:
        runner_up = float(totals[order[1]]) if k > 1 else float(np.partition(totals, count - 2)[count - 2])
        margin = float(totals[order[0]]) - runner_up
    else:
        margin = float(totals[order[0]])
    return order, confidence, margin


@dataclass(frozen=True)
class LikelihoodResult(BlockScores):
    """What the likelihood decoder read from one text under one key.

    scores: float64 [r, D] S[i, v]; row_counts: int64 [r] scored tokens per block;
    positions: int64 [m] the text positions scored; rows: int64 [m] their blocks;
    boosted: bool [m, D] B_t(v); weights: float64 [m, D] log LR_t(v); offsets: float64 [m, D]
    log(gamma LR + 1 - gamma); so llr = boosted * weights - offsets.
    """

    params: WatermarkParams
    temperature: float
    text_length: int
    scores: FloatArray
    row_counts: IntArray
    positions: IntArray
    rows: IntArray
    boosted: BoolArray
    weights: FloatArray = field(repr=False)
    offsets: FloatArray = field(repr=False)
    edit_rate: float = 0.0

    def token_llr(self, blocks: Sequence[int] | IntArray) -> FloatArray:
        """float64 [text_length]: each position's evidence (nats) for a message with these block
        values; NaN where the position was not scored."""
        values = np.asarray(blocks, dtype=np.int64)[self.rows]  # [m]
        picked = np.arange(self.rows.size)
        llr = self.boosted[picked, values] * self.weights[picked, values] - self.offsets[picked, values]
        out = np.full(self.text_length, np.nan)
        out[self.positions] = llr
        return out


def checked_text(
    token_ids: Sequence[int] | IntArray, scores: ModelScores, temperature: float, edit_rate: float
) -> IntArray:
    """The token ids of a text a likelihood reading can score (int64 [n]), or the reason it cannot."""
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ArgumentError(f"temperature must be a finite number > 0 (got {temperature})")
    if not 0.0 <= edit_rate < 1.0:
        raise ArgumentError(f"edit_rate must be in [0, 1) (got {edit_rate})")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise DecodeInputError("token ids must be one 1-D sequence of integers")
    ids = ids.astype(np.int64, copy=False)
    n = ids.size
    if n < 3:
        raise DecodeInputError("need a text of 3 or more tokens (the first two are context)")
    if ids.min() < 0 or ids.max() > MAX_TOKEN_ID:
        raise DecodeInputError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    if scores.token_logprobs.shape[0] != n:
        raise DecodeInputError(f"model scores cover {scores.token_logprobs.shape[0]} positions, the text has {n}")
    return ids


def score_text(
    token_ids: Sequence[int] | IntArray,
    scores: ModelScores,
    key: WatermarkKey,
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    edit_rate: float = DEFAULT_EDIT_RATE,
    skip_ids: Iterable[int] = (),
    dedup: bool = True,
) -> LikelihoodResult:
    """Score one text (its token ids, as the model read them) under ``key``.

    ``edit_rate``: the share of tokens assumed put in by an edit rather than generated (see the
    module's docstring); 0 reads every token as the model's.
    """
    if key.params.distortion_free:
        raise ParamsError(
            "score_text is the likelihood decoder of the biasing schemes; scheme 'gumbel' is read by decode() "
            "(counting) or score_gumbel_text() (model-aware)"
        )
    ids = checked_text(token_ids, scores, temperature, edit_rate)
    n = ids.size
    params = key.params
    r, shards_n = params.num_blocks, params.num_shards
    prev2, prev1, token = ids[:-2], ids[1:-1], ids[2:]  # position t = index + 2
    keep = np.isfinite(scores.token_logprobs[2:])
    skip = np.fromiter(skip_ids, dtype=np.int64)
    if skip.size:
        keep &= ~np.isin(token, skip)
    if dedup:
        order, first = _first_occurrences(prev2, prev1, token, int(ids.max()))
        unique = np.zeros(token.size, dtype=bool)
        unique[order[first]] = True
        keep &= unique
    index = np.flatnonzero(keep)  # [m]
    positions = index + 2
    p2, p1, tok = prev2[index], prev1[index], token[index]
    rows = block_index(p2, p1, r)  # [m]
    words = key.words
    boosted = _boosted(shard(words, p2, p1, tok, params.block_bits), params)  # [m, D]

    top_ids = scores.top_ids[positions]  # [m, K]
    top_p, own_p, rest_p, in_top = tempered(scores, positions, tok, temperature)

    gamma = boosted_share(params)
    multipliers = context_multipliers(words, p2, p1)  # [m, k]
    top_shards = shard_of(multipliers[:, None, :], token_codes(words, top_ids), params.block_bits)  # [m, K, k]
    top_boosted = _boosted(top_shards, params).astype(np.float64)  # [m, K, D]
    # A token scored elsewhere under the same context must not inform this position's weight (its
    # membership is that position's B): it counts at its expected membership gamma instead.
    top_boosted[_scored_elsewhere(p2, p1, tok, top_ids)] = gamma
    others = np.where(in_top, 0.0, top_p)  # [m, K]: x_t's own mass left out
    mass_without = np.einsum("mk,mkd->md", others, top_boosted) + (gamma * rest_p)[:, None]  # [m, D]
    a = params.delta / temperature
    boost = math.expm1(a)
    if edit_rate > 0.0:
        # x_t generated under the key (in E_v / not in E_v), or put there by an edit (any token, 1/V)
        with np.errstate(divide="ignore"):
            own = np.log(own_p)[:, None] + math.log1p(-edit_rate)  # [m, 1]
        edit = math.log(edit_rate / scores.vocab_size)
        inside = np.logaddexp(own + a - np.log1p(boost * (mass_without + own_p[:, None])), edit)  # [m, D]
        outside = np.logaddexp(own - np.log1p(boost * mass_without), edit)  # [m, D]
        weights = inside - outside
    else:
        weights = a + np.log1p(boost * mass_without) - np.log1p(boost * (mass_without + own_p[:, None]))  # [m, D]
    weights = np.clip(weights, 0.0, a)
    if params.gated:
        # the entropy rule: where the model's min-entropy (its top log-probability at temperature 1)
        # is below the key's threshold the encoder added no bias, so the position is no evidence
        weights[-scores.top_logprobs[positions].max(axis=1) < params.min_entropy] = 0.0
    offsets = np.log(gamma * np.exp(weights) + (1.0 - gamma))  # [m, D]
    llr = boosted * weights - offsets  # [m, D]
    block_scores = np.zeros((r, shards_n))
    np.add.at(block_scores, rows, llr)
    return LikelihoodResult(
        params=params,
        temperature=float(temperature),
        text_length=int(n),
        scores=block_scores,
        row_counts=np.bincount(rows, minlength=r).astype(np.int64),
        positions=positions.astype(np.int64),
        rows=rows.astype(np.int64),
        boosted=boosted,
        weights=weights,
        offsets=offsets,
        edit_rate=float(edit_rate),
    )


def tempered(
    scores: ModelScores, positions: IntArray, tok: IntArray, temperature: float
) -> tuple[FloatArray, FloatArray, FloatArray, BoolArray]:
    """The model at temperature tau at the given text positions, whose tokens are ``tok``: the top-K
    tokens' probabilities [m, K], the text's own token's [m], the rest's (spread evenly over the
    tokens beyond the top K) [m], and which top-K column is the text's token (bool [m, K])."""
    top_ids = scores.top_ids[positions]  # [m, K]
    top_lp = scores.top_logprobs[positions] / temperature  # [m, K]
    own_lp = scores.token_logprobs[positions] / temperature  # [m]
    in_top = top_ids == tok[:, None]  # [m, K]
    own_in_top = in_top.any(axis=1)  # [m]
    raw_top = np.exp(scores.top_logprobs[positions])  # [m, K] at temperature 1
    raw_own = np.exp(scores.token_logprobs[positions])
    rest_raw = np.clip(1.0 - raw_top.sum(axis=1) - np.where(own_in_top, 0.0, raw_own), 0.0, 1.0)  # [m]
    rest_count = scores.vocab_size - top_ids.shape[1] - (~own_in_top)  # [m]
    with np.errstate(divide="ignore"):
        rest_lp = np.log(rest_count) + (np.log(rest_raw) - np.log(rest_count)) / temperature  # [m]
    shift = np.maximum(top_lp.max(axis=1), own_lp)  # [m]
    top_p = np.exp(top_lp - shift[:, None])  # [m, K] unnormalised
    own_p = np.exp(own_lp - shift)
    rest_p = np.exp(rest_lp - shift)
    total = top_p.sum(axis=1) + np.where(own_in_top, 0.0, own_p) + rest_p  # [m]
    return top_p / total[:, None], own_p / total, rest_p / total, in_top


def _scored_elsewhere(p2: IntArray, p1: IntArray, tok: IntArray, top_ids: IntArray) -> BoolArray:
    """bool [m, K]: top token j of scored position t is the token of another scored position with
    t's context (x[t-2], x[t-1]). Contexts seen once (nearly all) are skipped at numpy speed."""
    out = np.zeros(top_ids.shape, dtype=bool)
    if tok.size < 2:
        return out
    _, context, counts = np.unique(np.stack([p2, p1], axis=1), axis=0, return_inverse=True, return_counts=True)
    context = context.reshape(-1)
    for t in np.flatnonzero(counts[context] > 1):
        same = np.flatnonzero(context == context[t])
        elsewhere = tok[same[same != t]]
        out[t] = np.isin(top_ids[t], elsewhere) & (top_ids[t] != tok[t])
    return out


def weighted_bernoulli_tail(
    weights: Sequence[int] | IntArray, observed: int, probability: float | Sequence[float] | FloatArray
) -> float:
    """P(sum_t w_t B_t >= observed) for independent B_t ~ Bernoulli(p_t), integer w_t >= 0;
    ``probability`` is one p for every t or one per weight.

    Exact (a convolution over the attainable sums, O(len(w) * sum(w)) in float64).
    """
    w = np.asarray(weights, dtype=np.int64)
    if w.size and w.min() < 0:
        raise ArgumentError("weights must be >= 0")
    probs = np.broadcast_to(np.asarray(probability, dtype=np.float64), w.shape)
    if observed <= 0:
        return 1.0
    total = int(w.sum())
    if observed > total:
        return 0.0
    dist = np.zeros(total + 1)
    dist[0] = 1.0
    reach = 0
    for step, p in zip(w.tolist(), probs.tolist(), strict=True):
        if step <= 0:
            continue
        moved = dist[: reach + 1] * p
        dist[: reach + 1] *= 1.0 - p
        dist[step : step + reach + 1] += moved
        reach += step
    return float(min(1.0, dist[observed:].sum()))


@dataclass(frozen=True)
class LikelihoodAttribution:
    """Who the likelihood decoder names. ``score`` of a candidate is its L(m) (nats); ``p_value``
    of the best is its exact test, corrected for the registry size and the other tests; ``confidence`` is
    its posterior over the registry; ``margin`` the gap in L to the runner-up."""

    candidates: list[CandidateScore]
    best: CandidateScore | None
    p_value: float
    confidence: float
    margin: float
    statistic: int
    bound: str = "exact weighted-Bernoulli tail under the keyed-hash null, Bonferroni over the registry"
    # ``identity_test`` of the best against every other registered message (None: not run)
    identity_p_value: float | None = None


def _units(result: LikelihoodResult, blocks: Sequence[int] | IntArray) -> tuple[IntArray, BoolArray, float]:
    """The integer weights u_t of the message with these block values, its memberships B_t, and
    the grid's steps per nat."""
    values = np.asarray(blocks, dtype=np.int64)[result.rows]  # [m]
    picked = np.arange(result.rows.size)
    weights = result.weights[picked, values]  # [m]
    hits: BoolArray = result.boosted[picked, values]  # [m]
    a = result.params.delta / result.temperature
    steps = float(WEIGHT_STEPS_PER_NAT)
    cells = max(1.0, weights.size * a * steps)
    if cells > MAX_TEST_CELLS:  # coarser grid: the test stays exact for its (rounded) statistic
        steps = max(1.0, steps * MAX_TEST_CELLS / cells)
    units: IntArray = np.ceil(weights * steps).astype(np.int64)  # [m]
    return units, hits, steps


def naming_test(result: LikelihoodResult, blocks: Sequence[int] | IntArray) -> tuple[float, int]:
    """The exact p-value (one candidate, uncorrected) that the text carries the message with these
    block values, and the observed statistic U on its integer grid."""
    units, hits, _ = _units(result, blocks)
    observed = int(units[hits].sum())
    return weighted_bernoulli_tail(units, observed, boosted_share(result.params)), observed


# the Chernoff bound's exponents, per nat of the weights
_CHERNOFF_LAMBDAS = np.geomspace(0.02, 8.0, 28)
# candidates the bound leaves are tested exactly; beyond this many the identity is not established
MAX_EXACT_RIVALS = 64
_RIVAL_CHUNK = 16_384


def identity_test(
    result: LikelihoodResult, named: Sequence[int] | IntArray, rivals: npt.NDArray[np.integer[Any]]
) -> float:
    """The p-value that the text carries one of ``rivals`` (int [C, r] block values) rather than
    ``named``: the largest, over the rivals, of the exact p-value of "the text carries m'".

    Against rival m', the statistic is U = sum of u_t B_t(named) over the positions of the blocks
    where m' differs from ``named`` (u_t: the named message's integer weights). If the text
    carries m', then given each B_t(m') those B_t(named) are independent Bernoulli(q_in or q_out)
    (``rival_shares``: the keyed hash alone fixes them, whatever the model or the text), so
    P(U >= observed) is exact. A wrong name needs the true message's test to reject, so naming
    only when this p-value is at most alpha names a wrong registered user with probability at most
    alpha, on any unedited watermarked text, with no correction for the registry's size (an edit
    or a mix of two users' texts voids the bound: see docs/xmark_core.md).

    Every rival is first bounded by Chernoff (vectorised over the registry); the at most
    ``MAX_EXACT_RIVALS`` the bound does not settle below the largest so far are tested exactly.
    """
    values = np.asarray(named, dtype=np.int64)
    if rivals.shape[0] == 0:
        return 0.0
    params = result.params
    r, shards = params.num_blocks, params.num_shards
    units, hits, steps = _units(result, values)
    q_in, q_out = rival_shares(params)
    q = np.where(result.boosted, q_in, q_out)  # [m, D]: P(B_t(named) = 1) if the text carries v here
    observed = np.zeros(r)
    np.add.at(observed, result.rows, units * hits)  # [r] O_i
    lam = _CHERNOFF_LAMBDAS / steps  # [L] per unit of the integer grid
    growth = np.expm1(lam[None, :] * units[:, None])  # [m, L]
    cumulant = np.zeros((r, shards, lam.size))  # [r, D, L]: sum_t log E exp(lam u_t B_t) in block i
    np.add.at(cumulant, result.rows, np.log1p(q[:, :, None] * growth[:, None, :]))
    cumulant[np.arange(r), values] = 0.0  # a rival's equal blocks are not in its statistic
    keep = MAX_EXACT_RIVALS + 1  # the largest bounds of each chunk: one more than are tested exactly
    unsettled: list[tuple[float, int]] = []
    blocks = np.arange(r)
    for first in range(0, rivals.shape[0], _RIVAL_CHUNK):
        part = rivals[first : first + _RIVAL_CHUNK].astype(np.int64)  # [c, r]
        differs = part != values[None, :]
        u_obs = (differs * observed[None, :]).sum(axis=1)  # [c]
        log_mgf = cumulant[blocks[None, :], part].sum(axis=1)  # [c, L]
        bound = np.exp(np.minimum(0.0, (log_mgf - lam[None, :] * u_obs[:, None]).min(axis=1)))  # [c]
        largest = np.argpartition(-bound, keep - 1)[:keep] if bound.size > keep else np.arange(bound.size)
        unsettled.extend((float(bound[i]), first + int(i)) for i in largest)

    def exact(index: int) -> float:
        rival = rivals[index].astype(np.int64)
        inside = (rival != values)[result.rows]  # [m] positions in the differing blocks
        rival_q = q[np.arange(result.rows.size), rival[result.rows]]
        return weighted_bernoulli_tail(units[inside], int(units[inside & hits].sum()), rival_q[inside])

    return largest_exact_p(unsettled, exact, MAX_EXACT_RIVALS)


def attribute_likelihood(
    result: LikelihoodResult,
    candidates: CandidateSet,
    *,
    top: int = 5,
    alpha: float = DEFAULT_ALPHA,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    multiplicity: Multiplicity | None = None,
    identity_level: float | None = None,
    rule: NamingRule | None = None,
) -> LikelihoodAttribution:
    """Score every registered message; name the best only if its corrected p-value is below
    ``alpha`` and its posterior at least ``min_confidence`` (``multiplicity``: the other tests run
    on the text, as for :func:`xmark_core.attribute`).

    ``identity_level``: also require ``identity_test`` against every other registered message at
    most this (a wrong registered user is then named with probability at most ``identity_level``
    on any watermarked text, whatever the model's calibration). Off by default: it costs naming
    (see docs/xmark_core.md)."""
    rule = rule_of(rule, alpha, min_confidence, identity_level)
    multiplicity = check_ranking(top, multiplicity)
    params = result.params
    if candidates.params.bits != params.bits or candidates.params.block_bits != params.block_bits:
        raise ParamsError("candidate messages do not match the decoder's message length")
    count = len(candidates)
    if count == 0 or result.scored_tokens == 0:
        return LikelihoodAttribution([], None, 1.0, 0.0, 0.0, 0)
    totals = candidates.hits(result.scores)  # float64 [C]: L(m)
    order, confidence, margin = rank_by_likelihood(totals, top)
    decoded = result.blocks
    factors = multiplicity.naming_factors(candidates, order, params)
    out = []
    p_best, statistic = 1.0, 0
    for rank, idx in enumerate(order):
        cand_blocks = candidates.blocks[idx].astype(np.int64)
        p_raw, observed = naming_test(result, cand_blocks)
        p_value = min(1.0, p_raw * float(factors[rank]))
        if rank == 0:
            p_best, statistic = p_value, observed
        hamming = _hamming_blocks(cand_blocks, decoded, params)
        out.append(
            CandidateScore(candidates.ids[idx], candidates.bits_of(int(idx)), float(totals[idx]), p_value, hamming)
        )
    named = rule.evidence_names(p_best, margin, confidence, lone=count == 1)
    identity = None
    level = rule.identity_bound(always=False)
    if named and level is not None:  # the best explains the text; does no other user?
        best = int(order[0])
        rivals = np.delete(candidates.blocks, best, axis=0)
        identity = identity_test(result, candidates.blocks[best].astype(np.int64), rivals)
        named = identity <= level
    return LikelihoodAttribution(
        out, out[0] if named else None, p_best, confidence, margin, statistic, identity_p_value=identity
    )
