"""The evaluation's scalar metrics against hand-computed and closed-form values."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from benchmarks.evaluation.metrics import bit_accuracy, detection_score, roc_auc, roc_curve, tpr_at_fpr


def test_bit_accuracy_counts_erasures_as_wrong() -> None:
    assert bit_accuracy("0110", "0110") == 1.0
    assert bit_accuracy("0111", "0110") == 0.75
    assert bit_accuracy("??10", "0110") == 0.5
    with pytest.raises(ValueError):
        bit_accuracy("011", "0110")


def test_roc_auc_matches_pairwise_definition_with_ties() -> None:
    pos, neg = [3.0, 2.0, 2.0, 0.5], [2.0, 1.0, 0.0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p in pos for n in neg]
    assert roc_auc(pos, neg) == pytest.approx(sum(pairs) / len(pairs))
    assert roc_auc([5.0], [1.0, 2.0]) == 1.0
    assert roc_auc([], [1.0]) is None


def test_roc_auc_of_identical_distributions_is_one_half() -> None:
    rng = np.random.default_rng(7)
    pos, neg = rng.normal(size=4000), rng.normal(size=4000)
    # standard error of the AUC under H0 is sqrt((n1+n2+1)/(12 n1 n2)) ~ 0.0046; allow 5 of them
    assert abs(roc_auc(pos, neg) - 0.5) < 5 * math.sqrt((8001) / (12 * 4000 * 4000))


def test_tpr_at_fpr_uses_the_null_quantile_and_refuses_unresolvable_levels() -> None:
    neg = list(range(100))  # 0..99
    pos = [98.5, 99.5, 50.0, 120.0]
    # at 1 % FPR one negative (99) may lie above the threshold: threshold = 98, TPR = 3/4
    assert tpr_at_fpr(pos, neg, 0.01) == 0.75
    # 0.1 % FPR needs at least 1000 negatives
    assert tpr_at_fpr(pos, neg, 0.001) is None
    neg_many = [float(v) for v in range(1000)]
    assert tpr_at_fpr([999.5, 998.5, 10.0], neg_many, 0.001) == pytest.approx(2 / 3)


def test_roc_curve_runs_from_origin_to_one() -> None:
    fpr, tpr = roc_curve([3.0, 1.0], [2.0, 0.0])
    assert (fpr[0], tpr[0]) == (0.0, 0.0)
    assert (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert all(a <= b for a, b in itertools.pairwise(fpr)) and all(a <= b for a, b in itertools.pairwise(tpr))


def test_detection_score_is_minus_log10_p() -> None:
    assert detection_score(1e-3) == pytest.approx(3.0)
    assert detection_score(0.0) == pytest.approx(300.0)
