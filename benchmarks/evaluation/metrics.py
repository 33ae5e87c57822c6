"""Scalar metrics: bit accuracy, Wilson intervals, ROC curve and AUC, TPR at a fixed FPR, means."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def bit_accuracy(decoded: str, truth: str) -> float:
    """Share of bits decoded right; an erased bit ('?') counts as wrong."""
    if len(decoded) != len(truth):
        raise ValueError("decoded and true messages differ in length")
    return sum(a == b for a, b in zip(decoded, truth, strict=True)) / len(truth)


def wilson(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default)."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))


def rate_cell(count: int, trials: int) -> dict[str, Any]:
    """A rate as the reports print it: count, trials, the share (4 decimals) and its Wilson interval."""
    return {
        "count": count,
        "of": trials,
        "rate": round(count / trials, 4) if trials else None,
        "ci95": wilson(count, trials),
    }


def mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def stderr(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def roc_auc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """P(score_pos > score_neg) + P(tie)/2 (Mann-Whitney), larger scores = more likely watermarked."""
    if not len(positives) or not len(negatives):
        return None
    pos = np.asarray(positives, dtype=np.float64)
    neg = np.sort(np.asarray(negatives, dtype=np.float64))
    below = np.searchsorted(neg, pos, side="left")
    at_or_below = np.searchsorted(neg, pos, side="right")
    return float((below + 0.5 * (at_or_below - below)).sum() / (pos.size * neg.size))


def tpr_at_fpr(positives: Sequence[float], negatives: Sequence[float], fpr: float) -> float | None:
    """TPR at the smallest threshold whose empirical FPR on the negatives is <= fpr (strict '>').

    None when there are fewer than 1/fpr negatives: the empirical FPR cannot resolve that level.
    """
    neg = np.sort(np.asarray(negatives, dtype=np.float64))
    if not len(positives) or neg.size < math.ceil(1.0 / fpr - 1e-9):
        return None
    allowed = math.floor(fpr * neg.size + 1e-9)  # negatives allowed above the threshold
    threshold = neg[neg.size - 1 - allowed]
    return float(np.mean(np.asarray(positives, dtype=np.float64) > threshold))


def roc_curve(positives: Sequence[float], negatives: Sequence[float]) -> tuple[list[float], list[float]]:
    """(fpr, tpr) points for every distinct threshold, from (0, 0) to (1, 1)."""
    pos = np.asarray(positives, dtype=np.float64)
    neg = np.asarray(negatives, dtype=np.float64)
    thresholds = np.unique(np.concatenate([pos, neg]))[::-1]
    fpr = [0.0] + [float(np.mean(neg >= t)) for t in thresholds]
    tpr = [0.0] + [float(np.mean(pos >= t)) for t in thresholds]
    return fpr, tpr


def detection_score(p_value: float) -> float:
    """-log10 p: larger = stronger evidence of a watermark."""
    return -math.log10(max(p_value, 1e-300))
