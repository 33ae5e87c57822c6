"""Null distributions of the decoder's statistics on unwatermarked text.

On text the key never touched, every scored (deduplicated) token draws its k shards
independently and uniformly (the hash is a keyed pseudo-random function of the triple), and
which row it lands in is fixed by the text. Given the block profile (tokens per row), rows are
therefore independent, and a row with n tokens is a sum of n i.i.d. per-token contributions.

* For a fixed candidate message, the number of trials hitting its cells is exactly
  Binomial(trials, q0) -- used for attribution (``binomial_log_cdf``).
* For the decoder's own best message (row minima) and the paper's mean row standard deviation,
  the per-row distribution is simulated once per (scheme, d, k, counting, n) with a seeded
  generator -- a multinomial over the distinct per-token contribution vectors, so the cost does
  not grow with n -- and cached; rows are then combined exactly by convolution (row minima) or
  by seeded resampling (standard deviation).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ROW_SAMPLES = 100_000
SIGMA_SAMPLES = 20_000
_MAX_ENUMERATED = 4096


@dataclass(frozen=True)
class RowNull:
    """Null of one row with n tokens: pmf of its decisive count (min, or max for MPAC) and std samples."""

    offset: int
    pmf: np.ndarray  # float64, pmf[j] = P(decisive == offset + j)
    sigma: np.ndarray  # float64 [SIGMA_SAMPLES], the row's population std under the null


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


@lru_cache(maxsize=64)
def contributions(shards: int, keys: int, constrained: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Distinct per-token contribution vectors [m, D] and their probabilities [m], or None if too many."""
    if shards**keys > _MAX_ENUMERATED:
        return None
    vectors: dict[tuple[int, ...], int] = {}
    for draw in itertools.product(range(shards), repeat=keys):
        vec = [0] * shards
        for s in draw:
            vec[s] = 1 if constrained else vec[s] + 1
        vectors[tuple(vec)] = vectors.get(tuple(vec), 0) + 1
    table = np.array(list(vectors.keys()), dtype=np.int64)
    probs = np.array(list(vectors.values()), dtype=np.float64) / shards**keys
    return table, probs


def _simulate_rows(n: int, shards: int, keys: int, constrained: bool, samples: int, seed: int) -> np.ndarray:
    """int64 [samples, D] null count vectors of a row with n tokens."""
    rng = np.random.default_rng(seed)
    enumerated = contributions(shards, keys, constrained)
    if enumerated is not None:
        table, probs = enumerated
        counts: np.ndarray = rng.multinomial(n, probs, size=samples) @ table
        return counts
    out = np.zeros((samples, shards), dtype=np.int64)
    chunk = max(1, 2_000_000 // max(1, n * keys))
    for start in range(0, samples, chunk):
        m = min(chunk, samples - start)
        draws = rng.integers(0, shards, size=(m, n, keys))  # [m, n, k]
        onehot = np.zeros((m, n, shards), dtype=np.int64)
        if constrained:
            np.put_along_axis(onehot, draws, 1, axis=2)
        else:
            eye = np.eye(shards, dtype=np.int64)
            for j in range(keys):
                onehot += eye[draws[:, :, j]]
        out[start : start + m] = onehot.sum(axis=1)
    return out


@lru_cache(maxsize=2048)
def row_null(n: int, shards: int, keys: int, constrained: bool, upper: bool) -> RowNull:
    """Null of one row with n >= 1 tokens (upper=True: MPAC's row maximum)."""
    counts = _simulate_rows(n, shards, keys, constrained, ROW_SAMPLES, _seed("row", n, shards, keys, constrained))
    decisive = counts.max(axis=1) if upper else counts.min(axis=1)
    low = int(decisive.min())
    pmf = np.bincount(decisive - low).astype(np.float64) / ROW_SAMPLES
    sigma = counts[:SIGMA_SAMPLES].std(axis=1)
    return RowNull(offset=low, pmf=pmf, sigma=sigma)


def sum_pmf(rows: list[RowNull]) -> tuple[int, np.ndarray]:
    """Exact convolution of independent rows' decisive-count pmfs: (offset, pmf of the sum)."""
    offset, pmf = 0, np.ones(1)
    for row in rows:
        pmf = np.convolve(pmf, row.pmf)
        offset += row.offset
    return offset, pmf


def sigma_tail(rows: list[RowNull], num_blocks: int, observed: float, samples: int, seed: int) -> float:
    """P(mean row std >= observed) under the null, by seeded resampling of the cached row samples."""
    if not rows:
        return 1.0
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, SIGMA_SAMPLES, size=(len(rows), samples), dtype=np.int32)  # [rows, samples]
    total = np.zeros(samples)
    for row, pick in zip(rows, picks, strict=True):
        total += row.sigma[pick]
    sims = total / num_blocks
    exceed = int(np.count_nonzero(sims >= observed - 1e-12))
    return (exceed + 1) / (samples + 1)


def binomial_log_pmf(trials: int, q: float) -> np.ndarray:
    """log P(X = j), j = 0..trials, X ~ Binomial(trials, q)."""
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, trials + 1, dtype=np.float64)))])
    j = np.arange(trials + 1, dtype=np.float64)
    logpmf: np.ndarray = (
        log_fact[trials] - log_fact[: trials + 1] - log_fact[::-1] + j * np.log(q) + (trials - j) * np.log1p(-q)
    )
    return logpmf


def binomial_log_cdf(values: np.ndarray, trials: int, q: float, upper: bool = False) -> np.ndarray:
    """log P(X <= v) (or log P(X >= v) with upper=True) for each v, X ~ Binomial(trials, q)."""
    logpmf = binomial_log_pmf(trials, q)
    # upper: log P(X >= j), accumulated from the top; otherwise log P(X <= j)
    cum = np.logaddexp.accumulate(logpmf[::-1])[::-1] if upper else np.logaddexp.accumulate(logpmf)
    idx = np.clip(np.asarray(values, dtype=np.int64), 0, trials)
    return cum[idx]
