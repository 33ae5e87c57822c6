"""The distortion-free multi-bit scheme ``gumbel``: exponential (Gumbel-max) sampling keyed by the block value.

Encoder. At the step that writes x[t], with context (x[t-2], x[t-1]), the block i = (x[t-2] + x[t-1])
mod r carries the user's value v = m_i. Every token w of the vocabulary gets a keyed uniform number
u(w) = U(key, x[t-2], x[t-1], w, v) in (0, 1), and the next token is

    x[t] = argmax_w u(w) ** (1 / p(w))  =  argmax_w (logits(w) / tau + g(w)),  g(w) = -log(-log u(w)),

p being the model's distribution at the request's temperature tau, truncated by the request's top-k,
top-p and min-p where it sets them (:func:`truncate_`; exponential sampling; the Gumbel-max form on the
right is what the op computes). Over the key, that choice has exactly the distribution p:
the watermark changes no answer's distribution (distortion-free, unlike the biasing schemes), which is
what the multi-bit form of "Three Bricks" does with a message-dependent shift of the random vector; here
the block value enters the hash instead of shifting it. What it costs instead: given the key, the user and
the context, the choice is fixed. Within one answer, a context that already occurred is sampled normally
(``active`` off, see :func:`repeated_context`): a fixed choice there would repeat the same continuation
forever. So the same user asking the same prompt gets the same answer, whatever the temperature and the
seed, up to the first context that recurs in it; from there the request's own randomness lets answers
part (the n > 1 completions of one request likewise). docs/results/QUALITY-GUMBEL.md measures how alike
such answers are.

Decoder. Every scored token (the first occurrence of each (x[t-2], x[t-1], x[t]) triple, as the cTMM
decoder) adds s = -log(1 - U(key, x[t-2], x[t-1], x[t], v)) to cell [i, v] of an [r, D] matrix, for
each of the D = 2**d values v. For a fixed candidate message m, S_m = sum_i M[i, m_i] is, on text not
written with the key, a sum of n independent Exp(1) variables: Gamma(n, 1) exactly, whatever the text, so
a candidate's p-value is the Gamma tail (no simulation, no approximation). Watermarked with m, the chosen
token's u is pushed towards 1 wherever the model had a choice, and S_m grows by about the entropy of
each step. Detection (is the text watermarked at all) uses the best message, sum_i max_v M[i, v], whose
null law is the sum over rows of the maximum of D independent Gamma(n_i, 1): computed on a grid with
every row's maximum rounded up, so the p-value is conservative by at most the grid's step.

Salts. With ``salts`` S > 1 an answer is written under one salt s in [0, S): block value v enters the
hash as v + s * D, so answers under different salts are sampled independently (the same user's answers
to one prompt then differ as unwatermarked answers do). The decoders score every token under all D * S
values, keep the salt whose best message scores highest (:func:`pick_salt`) and multiply every p-value by
S: by the union bound over salts, the p-value of the kept salt stays valid whichever salt the text
picked.

The uniforms come from the shard hash's keyed context multiplier and token code (``hashing``): their
product modulo 2**32, XORed with a keyed code of v and finalised by ``mix32``, identical in numpy and in
torch on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from .errors import ParamsError
from .hashing import MASK32, MIX_MUL, mix32, wrap32

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    from .hashing import Array
    from .params import WatermarkParams

_GOLDEN = 0x9E3779B1  # the value code's multiplier: (v + 1) * _GOLDEN < 2**37, no overflow in int64
_SCALE = 1.0 / (1 << 32)
# the detection null's grid step (score units, nats); p-values are conservative by at most this much
GRID_STEP = 0.02
# the smallest detection p-value reported (the grid's convolutions lose smaller tails in round-off)
DETECTION_FLOOR = 1e-12


def value_codes(words: Array, values: Array) -> Array:
    """Keyed codes of block values. words: int64 [1, 5]; values: int64 [...] in [0, 2**d * S)
    (salted values, see :func:`salted`)."""
    return mix32((((values + 1) * _GOLDEN) & MASK32) ^ words[0, 2])


def salted(blocks: npt.NDArray[np.int64], salt: int, params: WatermarkParams) -> npt.NDArray[np.int64]:
    """The values an answer written under ``salt`` carries: v + salt * 2**d per block (salt 0: the
    blocks themselves). blocks: int64 [..., r] in [0, 2**d)."""
    if isinstance(salt, bool) or not isinstance(salt, (int, np.integer)) or not 0 <= salt < params.salts:
        raise ParamsError(f"salt must be an integer in [0, {params.salts}) for this key (got {salt!r})")
    out: npt.NDArray[np.int64] = np.asarray(blocks, dtype=np.int64) + int(salt) * params.num_shards
    return out


def pick_salt(matrix: npt.NDArray[np.float64], row_counts: npt.NDArray[np.int64], salts: int) -> int:
    """The salt whose best message scores highest: argmax over s of sum over occupied rows of
    max_v matrix[i, s * D + v]. matrix: [r, D * S] scores (larger: more evidence)."""
    if salts == 1:
        return 0
    r = matrix.shape[0]
    per_salt = matrix.reshape(r, salts, -1).max(axis=2)  # [r, S]
    occupied = row_counts > 0
    return int(per_salt[occupied].sum(axis=0).argmax())


def hashed(multipliers: Array, codes: Array, value_code: Array) -> Array:
    """int64 in [0, 2**32): the keyed draw of (context, token, value) from broadcastable operands."""
    return mix32(((multipliers * codes) & MASK32) ^ value_code)


def token_scores(
    words: npt.NDArray[np.int64],
    prev2: npt.NDArray[np.int64],
    prev1: npt.NDArray[np.int64],
    token: npt.NDArray[np.int64],
    num_values: int,
) -> npt.NDArray[np.float64]:
    """float64 [n, D]: s = -log(1 - u) of every token under each block value v (Exp(1) on text not
    written with the key)."""
    from .hashing import context_multipliers, token_codes

    multipliers = context_multipliers(words, prev2, prev1)[:, :1]  # [n, 1]
    codes = token_codes(words, token)[:, :1]  # [n, 1]
    values = value_codes(words, np.arange(num_values, dtype=np.int64))[None, :]  # [1, D]
    draws = hashed(multipliers, codes, values)  # [n, D]
    u = (draws.astype(np.float64) + 0.5) * _SCALE
    scores: npt.NDArray[np.float64] = -np.log1p(-u)
    return scores


def gamma_log_sf(scores: npt.NDArray[np.float64], tokens: int) -> npt.NDArray[np.float64]:
    """log P(Gamma(tokens, 1) >= score), elementwise: a candidate's exact log tail on unwatermarked text."""
    from scipy import stats  # type: ignore[import-untyped]

    if tokens <= 0:
        return np.zeros_like(scores, dtype=np.float64)
    out: npt.NDArray[np.float64] = stats.gamma.logsf(scores, tokens)
    return out


def gamma_log_sf_each(scores: npt.NDArray[np.float64], tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """log P(Gamma(tokens_j, 1) >= scores_j) per element; 0 (p = 1) where tokens_j is 0."""
    from scipy import stats

    out = np.zeros(scores.shape, dtype=np.float64)
    some = tokens > 0
    out[some] = stats.gamma.logsf(scores[some], tokens[some])
    return out


def detection_log_sf(row_counts: npt.NDArray[np.int64], observed: float, num_values: int) -> float:
    """log P(sum_i max_v G[i, v] >= observed) for independent G[i, v] ~ Gamma(n_i, 1), D values per
    row (the best message's score on unwatermarked text). Each row's maximum is rounded up to the
    grid, so the tail is over-stated (conservative) by at most one step per row."""
    present = tuple(int(n) for n in row_counts if n > 0)
    if not present:
        return 0.0
    offset, pmf = _sum_of_maxima(tuple(sorted(present)), num_values)
    j = int(np.floor(observed / GRID_STEP)) - offset  # grid cells whose value (upper edge) is >= observed
    if j <= 0:
        return 0.0
    if j >= pmf.size:
        return float(np.log(DETECTION_FLOOR))
    # the FFT's round-off (about 1e-16 of the mass per cell) makes smaller tails unreliable: floor them
    return float(np.log(max(float(pmf[j:].sum()), DETECTION_FLOOR)))


@lru_cache(maxsize=256)
def _row_max_pmf(tokens: int, num_values: int) -> tuple[int, npt.NDArray[np.float64]]:
    """(first cell, pmf) of ceil(max_v G_v / step) for D independent Gamma(tokens, 1)."""
    from scipy import stats

    top = stats.gamma.isf(1e-18, tokens)  # beyond it the mass is negligible for any test level here
    cells = int(np.ceil(top / GRID_STEP)) + 1
    edges = np.arange(cells + 1, dtype=np.float64) * GRID_STEP
    cdf = stats.gamma.cdf(edges, tokens) ** num_values
    cdf[-1] = 1.0  # the rest of the tail goes to the last cell (rounded down there: negligible, < 1e-17)
    pmf = np.diff(cdf)  # pmf[c] = P(max in (c*step, (c+1)*step]) -> its value rounds up to cell c + 1
    first = int(np.argmax(pmf > 0))
    return first + 1, pmf[first:]


@lru_cache(maxsize=1024)
def _sum_of_maxima(counts: tuple[int, ...], num_values: int) -> tuple[int, npt.NDArray[np.float64]]:
    """(first cell, pmf) of the sum over rows of their rounded-up maxima (FFT convolutions)."""
    from scipy import signal

    offset, pmf = 0, np.ones(1, dtype=np.float64)
    for n in counts:
        first, row = _row_max_pmf(n, num_values)
        pmf = np.clip(signal.fftconvolve(pmf, row), 0.0, None)
        offset += first
    return offset, pmf


def repeated_context(ids: torch.Tensor, start: int) -> torch.Tensor:
    """bool [B]: rows whose current context (the last two ids) was already the context of a token
    generated at position >= ``start`` (the first generated position) in the same row."""
    import torch

    length = ids.shape[1]
    if length - start < 1 or start < 2:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    earlier2 = ids[:, start - 2 : length - 2]  # contexts of the tokens at start .. length - 1
    earlier1 = ids[:, start - 1 : length - 1]
    hit = (earlier2 == ids[:, -2:-1]) & (earlier1 == ids[:, -1:])
    return hit.any(dim=1)


@dataclass(frozen=True)
class Truncation:
    """Each row's nucleus settings, as the serving engine reads them: ``top_k`` int [B] (0 or >= V:
    off), ``top_p`` float [B] (1: off), ``min_p`` float [B] (0: off); None: off for every row.

    The keyed sampler applies them itself, to the model's distribution at the row's temperature,
    before its choice (:func:`truncate_`): the choice then has exactly the truncated distribution a
    sampler without the watermark would draw from. The engine's own top-k / top-p / min-p, run after
    the sampler left one token finite, return that token.
    """

    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None

    def rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """bool [B]: the rows some setting truncates."""
        import torch

        hit = torch.zeros(batch, dtype=torch.bool, device=device)
        if self.top_k is not None:
            hit |= self.top_k.to(device) > 0
        if self.top_p is not None:
            hit |= self.top_p.to(device) < 1.0
        if self.min_p is not None:
            hit |= self.min_p.to(device) > 0.0
        return hit


def truncate_(logits: torch.Tensor, temperature: torch.Tensor, active: torch.Tensor, truncation: Truncation) -> None:
    """Set to -inf, in place, the tokens each active row's nucleus settings remove from its
    distribution at its temperature (logits [B, V], temperature float [B], active bool [B]); other
    rows, rows with temperature <= 0 and rows without a setting are left alone (the engine truncates
    those itself: truncating twice would not be the same distribution). Works on the whole batch
    without a device-to-host synchronisation: pass None instead of a Truncation no row uses.

    vLLM's order and rules (``Sampler``: min-p, then top-k and top-p together; ``apply_top_k_top_p``),
    in float32 as there: min-p drops tokens below min_p times the top probability; top-k keeps the
    tokens whose logit is at least the k-th largest; top-p drops, in ascending order of probability,
    the tokens whose cumulative mass is at most 1 - p, never the last. transformers'
    ``TopPLogitsWarper`` applies the same top-p rule.
    """
    import torch

    vocab = logits.shape[1]
    device = logits.device
    live = active.to(device) & (temperature.to(device) > 0)
    hit = truncation.rows(logits.shape[0], device) & live  # [B]
    tau = torch.where(live, temperature.to(device), torch.ones_like(temperature, device=device))
    scaled = logits.to(torch.float32) / tau.to(torch.float32)[:, None]  # [B, V], a copy
    if truncation.min_p is not None:
        min_p = torch.where(hit, truncation.min_p.to(device=device, dtype=torch.float32), 0.0)[:, None]
        probs = scaled.softmax(dim=1)
        scaled.masked_fill_(probs < min_p * probs.amax(dim=1, keepdim=True), float("-inf"))
    ordered, order = scaled.sort(dim=1)  # ascending
    if truncation.top_k is not None:
        k = truncation.top_k.to(device=device, dtype=torch.int64)
        k = torch.where(hit & (k > 0) & (k <= vocab), k, vocab)
        kth = ordered.gather(1, (vocab - k)[:, None])  # [B, 1] the k-th largest logit
        ordered.masked_fill_(ordered < kth, float("-inf"))
    if truncation.top_p is not None:
        top_p = torch.where(hit, truncation.top_p.to(device=device, dtype=torch.float32), 1.0)[:, None]
        dropped = ordered.softmax(dim=1).cumsum(dim=1) <= 1.0 - top_p
        dropped[:, -1] = False
        ordered.masked_fill_(dropped, float("-inf"))
    removed = torch.zeros_like(ordered, dtype=torch.bool).scatter_(1, order, torch.isneginf(ordered))
    logits.masked_fill_(removed & hit[:, None], float("-inf"))


def draws32(multipliers: torch.Tensor, codes: torch.Tensor, value_code: torch.Tensor) -> torch.Tensor:
    """:func:`hashed` in 32-bit lanes: int32 with the same 32 bits (the draw is ``x mod 2**32``).

    multipliers, codes and value_code are int32 (the int64 operands wrapped to their low 32 bits)
    and broadcastable. A product of int32 lanes keeps the low 32 bits of the int64 product (two's
    complement wraps modulo 2**32); an arithmetic right shift masked to its low 16 bits is the
    logical shift ``mix32`` takes. On a CPU without 64-bit vector multiplies (AVX2) this is several
    times less work per token than the int64 form.
    """
    x = (multipliers * codes) ^ value_code
    for _ in range(2):
        x = x ^ ((x >> 16) & 0xFFFF)
        x = x * MIX_MUL
    return x ^ ((x >> 16) & 0xFFFF)


def gumbel_noise(draws: torch.Tensor) -> torch.Tensor:
    """float32 g = -log(-log u), u = (draw + 0.5) / 2**32, from int32 draws (:func:`draws32`).

    In float32 without losing the tails that decide the choice: with t = (x + 0.5) / 2**32 for the
    signed draw x, u is t where x >= 0 (u <= 1/2: -log u is well conditioned) and 1 + t where x < 0,
    where -log u = -log1p(t) is evaluated as -log(1 + t) * t / ((1 + t) - 1) (exact up to rounding
    wherever 1 + t is not 1, and t itself where it is), so u = 1 - 2**-33 still gives g = 22.2
    instead of an infinite or flattened tail. One log for -log u, one for g: the same values as the
    float64 form to float32 precision (tested), with twice the lanes per vector.
    """
    import torch

    t = (draws.to(torch.float32) + 0.5) * _SCALE  # (0, 1/2] or [-1/2, 0)
    low = draws >= 0
    u = torch.where(low, t, 1.0 + t)
    step = u - 1.0  # t rounded as 1 + t keeps it; 0 where 1 + t rounds to 1
    exact = step == 0
    ratio = torch.where(low | exact, 1.0, t / torch.where(exact, 1.0, step))
    minus_log_u = torch.where(exact & ~low, -t, -torch.log(u) * ratio)  # -log u > 0
    return -torch.log(minus_log_u)


def sample_(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    context: torch.Tensor,
    blocks: torch.Tensor,
    active: torch.Tensor,
    *,
    words: torch.Tensor,
    codes: torch.Tensor,
    num_blocks: int,
) -> None:
    """Choose every active row's next token by keyed Gumbel-max sampling and leave only it finite.

    logits [B, V] (written in place); temperature float [B] (rows with temperature <= 0 are greedy
    requests: left untouched); context int64 [B, 2]; blocks int64 [B, r]; active bool [B]; words
    int64 [1, 5]; codes int32 [1, >= V], the token codes wrapped to 32 bits, or their bit pattern
    viewed as float32 (what the fused CPU kernel reads: see ``encoder._fused_apply32_``). Afterwards
    an active row has one finite logit, its chosen token's, so any sampler (temperature, top-k,
    top-p, greedy) returns that token. The draws are :func:`hashed`'s, in 32-bit lanes
    (:func:`draws32`), and the choice is made in float32 (:func:`gumbel_noise`).
    """
    import torch

    vocab = logits.shape[1]
    codes32 = codes.view(torch.int32) if codes.dtype == torch.float32 else codes
    prev2, prev1 = context[:, 0], context[:, 1]
    value = blocks.gather(1, ((prev2 + prev1) % num_blocks)[:, None])  # [B, 1]
    from .hashing import context_multipliers

    multipliers = context_multipliers(words, prev2, prev1)[:, :1]  # [B, 1] int64 in [1, 2**31)
    row = torch.cat([multipliers, value_codes(words, value)], dim=1)  # [B, 2] int64 in [0, 2**32)
    row = wrap32(row)  # int32, the same low 32 bits
    noise = gumbel_noise(draws32(row[:, :1], codes32[:1, :vocab], row[:, 1:]))  # [B, V] float32
    live = active & (temperature > 0)
    tau = torch.where(live, temperature, torch.ones_like(temperature)).to(torch.float32)[:, None]
    chosen = (logits.to(torch.float32) / tau + noise).argmax(dim=1, keepdim=True)  # -inf never wins
    keep = (torch.arange(vocab, device=logits.device)[None, :] == chosen) | ~live[:, None]
    logits.masked_fill_(~keep, float("-inf"))
