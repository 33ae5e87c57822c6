"""Is a text watermarked? Calibrated p-values for the observed token count and block profile.

Two statistics are computed, both against the exact null of the observed profile (see ``null``):

* ``min_shard_deficit`` (the verdict): the sum over rows of the smallest cell count (the largest
  for MPAC). It is the generalised likelihood-ratio statistic of "each token avoids its block's
  message shard with elevated probability" maximised over all 2**b messages, so it uses the same
  evidence the decoder reads; rows with more tokens weigh more, as they should.
* ``sigma``: the paper's mean of the row standard deviations, with its p-value from the same null
  (reported for comparison; the paper's fixed threshold sigma > 3.30 holds for one (b, T) only).
  Its p-value is a resampling estimate that costs about as much as decoding a 300-token text;
  callers that do not report it pass ``sigma_test=False``.

The p-value of the verdict statistic is P(S <= s_obs) under the null (conservative for the
discrete statistic), floored at the Monte-Carlo resolution 1/ROW_SAMPLES.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import gumbel
from .decoder import DecodeResult
from .errors import ArgumentError
from .naming import DEFAULT_ALPHA, Multiplicity
from .null import ROW_SAMPLES, RowNull, _seed, row_null, sigma_tail, sum_pmf
from .params import WatermarkParams

__all__ = ["DEFAULT_ALPHA", "Detection", "detect", "sigma_statistic", "warm_null_cache"]
SIGMA_RESAMPLES = 4_000
P_VALUE_FLOOR = 1.0 / ROW_SAMPLES


@dataclass(frozen=True)
class Detection:
    is_watermarked: bool
    p_value: float
    statistic: float
    statistic_name: str
    sigma: float
    sigma_p_value: float | None  # None when detect() was called with sigma_test=False
    alpha: float


def sigma_statistic(result: DecodeResult) -> float:
    """The paper's false-positive statistic of a biasing scheme's reading: the mean over the cTMM's
    rows of each row's standard deviation (large where a watermark concentrated the counts). Its
    level depends on the text's length and block profile; ``detect`` calibrates a p-value for it."""
    return float(result.matrix.std(axis=1).mean())


def detect(
    result: DecodeResult,
    *,
    alpha: float = DEFAULT_ALPHA,
    sigma_test: bool = True,
    multiplicity: Multiplicity | None = None,
) -> Detection:
    """Test the decoded cTMM against unwatermarked text at level alpha.

    ``multiplicity``: the other tests run on the same text; the p-value is corrected for them
    (``Multiplicity.detection_factor``: the tries, and the salts a ``gumbel`` reading chose among)
    and the verdict is that p-value below ``alpha``. None: this test alone (its salts still count).
    ``sigma_test=False`` skips the p-value of the paper's sigma statistic (``sigma_p_value`` is
    then None, and it is never corrected); the verdict, its p-value and ``sigma`` itself are the
    same either way.
    """
    if not 0.0 < alpha < 1.0:
        raise ArgumentError(f"alpha must be in (0, 1) (got {alpha})")
    multiplicity = Multiplicity() if multiplicity is None else multiplicity
    params = result.params
    if params.distortion_free:
        return _detect_gumbel(result, alpha, multiplicity)
    upper = params.scheme == "mpac"
    matrix = result.matrix
    sigma = sigma_statistic(result)
    present = [int(n) for n in result.row_counts if n > 0]
    if not present:
        return Detection(False, 1.0, 0.0, "min_shard_deficit", sigma, 1.0 if sigma_test else None, alpha)
    rows: list[RowNull] = [row_null(n, params.num_shards, params.num_keys, result.constrained, upper) for n in present]
    occupied = result.row_counts > 0
    decisive = matrix.max(axis=1) if upper else matrix.min(axis=1)
    observed = int(decisive[occupied].sum())
    offset, pmf = sum_pmf(rows)
    j = observed - offset
    if upper:
        tail = float(pmf[max(j, 0) :].sum()) if j < pmf.size else 0.0
    else:
        tail = float(pmf[: j + 1].sum()) if j >= 0 else 0.0
    p_value = min(1.0, max(tail, P_VALUE_FLOOR) * multiplicity.detection_factor(params))
    sigma_p: float | None = None
    if sigma_test:
        seed = _seed("sigma", tuple(result.row_counts.tolist()))
        sigma_p = float(sigma_tail(rows, params.num_blocks, sigma, SIGMA_RESAMPLES, seed))
    # expected decisive sum under the null, for a readable effect size
    expected = float(sum(r.offset + np.dot(np.arange(r.pmf.size), r.pmf) for r in rows))
    deficit = (observed - expected) if upper else (expected - observed)
    return Detection(
        is_watermarked=p_value < alpha,
        p_value=p_value,
        statistic=float(deficit),
        statistic_name="min_shard_deficit",
        sigma=sigma,
        sigma_p_value=sigma_p,
        alpha=alpha,
    )


def _detect_gumbel(result: DecodeResult, alpha: float, multiplicity: Multiplicity) -> Detection:
    """The ``gumbel`` scheme's test: the best message's score, sum over rows of the row's largest
    cell, against its null (sum of maxima of independent Gamma(n_i, 1), ``gumbel.detection_log_sf``).
    The statistic reported is that score minus the n scored tokens (its excess over one message's
    null mean); ``sigma`` is the mean row standard deviation, as for the counting schemes, without
    a p-value. With salts, the p-value is S times the read salt's (union bound over salts, counted
    by ``multiplicity`` with the tries)."""
    matrix = result.matrix
    sigma = float(matrix.std(axis=1).mean())
    occupied = result.row_counts > 0
    if not occupied.any():
        return Detection(False, 1.0, 0.0, "best_message_score", sigma, None, alpha)
    observed = float(matrix.max(axis=1)[occupied].sum())
    log_tail = gumbel.detection_log_sf(result.row_counts, observed, result.params.num_shards)
    p_value = min(1.0, multiplicity.detection_factor(result.params) * float(np.exp(log_tail)))
    statistic = observed - float(result.row_counts.sum())
    return Detection(p_value < alpha, p_value, statistic, "best_message_score", sigma, None, alpha)


def warm_null_cache(
    params: WatermarkParams, max_row_tokens: int, *, constrained: bool = True, min_row_tokens: int = 1
) -> int:
    """Pre-compute the per-row null distributions for rows of min_row_tokens..max_row_tokens tokens.

    ``detect`` simulates each row size by seeded sampling the first time it meets it, then caches
    it; a service can call this at start-up, off the request path, so that the first traces do not
    pay for the simulations.
    Returns the number of row sizes prepared.
    """
    upper = params.scheme == "mpac"
    first = max(1, min_row_tokens)
    for n in range(first, max_row_tokens + 1):
        row_null(n, params.num_shards, params.num_keys, constrained, upper)
    return max(0, max_row_tokens - first + 1)
