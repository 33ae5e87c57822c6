"""Calibrated detection: false-positive rates on null text, wrong secrets, watermarked text."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from xmark_core import CandidateSet, WatermarkKey, WatermarkParams, attribute, decode, detect
from xmark_core.params import Scheme

from .synthetic import OTHER_SECRET, SECRET, generate, random_messages

TRIALS = 2000
LENGTH = 200  # scored tokens per null text
VOCAB = 49_152


def _band(alpha: float, n: int, z: float = 3.5) -> float:
    return z * np.sqrt(alpha * (1 - alpha) / n)


@pytest.fixture(scope="module")
def null_detections(key: WatermarkKey):
    """detect() on TRIALS uniformly random texts of LENGTH scored tokens."""
    rng = np.random.default_rng(70)
    out = []
    for _ in range(TRIALS):
        r = decode(rng.integers(0, VOCAB, LENGTH + 2), key)
        assert r.scored_tokens >= LENGTH - 1  # a repeated triple is rare at this vocabulary size
        out.append(detect(r, alpha=0.01))
    return out


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_false_positive_rate_at_one_percent(null_detections) -> None:
    p = np.array([d.p_value for d in null_detections])
    fpr = float((p < 0.01).mean())
    assert 0.005 <= fpr <= 0.015, fpr
    assert np.mean([d.is_watermarked for d in null_detections]) == fpr  # verdict at alpha=0.01


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_null_p_values_are_super_uniform(null_detections) -> None:
    p = np.array([d.p_value for d in null_detections])
    assert p.min() >= 1e-5 and p.max() <= 1.0
    for alpha in (0.001, 0.01, 0.05, 0.1, 0.2, 0.5):
        fpr = float((p < alpha).mean())
        assert fpr <= alpha + _band(alpha, TRIALS), (alpha, fpr)
    # conservative only by the discreteness of the statistic, not grossly
    assert (p < 0.05).mean() >= 0.03 and (p < 0.2).mean() >= 0.15


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_sigma_p_value_is_calibrated_too(null_detections) -> None:
    sp = np.array([d.sigma_p_value for d in null_detections])
    for alpha in (0.01, 0.05, 0.2):
        fpr = float((sp < alpha).mean())
        assert abs(fpr - alpha) <= _band(alpha, TRIALS), (alpha, fpr)


def test_skipping_the_sigma_test_changes_nothing_else(key: WatermarkKey) -> None:
    """sigma_test=False (what /trace uses) leaves the verdict, its p-value and sigma as they are."""
    rng = np.random.default_rng(71)
    texts = [rng.integers(0, VOCAB, 150) for _ in range(20)]
    texts += list(generate(key, random_messages(key.params, 5, seed=73), 150, seed=72).tokens)  # watermarked
    texts.append(np.array([5, 9, 5, 9, 5]))  # a very short text
    for tokens in texts:
        result = decode(tokens, key)
        full, lean = detect(result), detect(result, sigma_test=False)
        assert lean.sigma_p_value is None and full.sigma_p_value is not None
        assert (lean.is_watermarked, lean.p_value, lean.statistic, lean.sigma) == (
            full.is_watermarked,
            full.p_value,
            full.statistic,
            full.sigma,
        )
    assert any(detect(decode(t, key), sigma_test=False).is_watermarked for t in texts[20:25])


@pytest.mark.parametrize(("scheme", "k"), [("mpac", 1), ("loso", 1), ("xmark", 4)])
@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_other_schemes_are_calibrated(scheme: Scheme, k: int) -> None:
    key = WatermarkKey.from_secret(SECRET, WatermarkParams(bits=16, scheme=scheme, num_keys=k))
    rng = np.random.default_rng(71 + k)
    n = 800
    p = np.array([detect(decode(rng.integers(0, VOCAB, LENGTH + 2), key)).p_value for _ in range(n)])
    for alpha in (0.05, 0.2):
        assert (p < alpha).mean() <= alpha + _band(alpha, n), (alpha, (p < alpha).mean())
    assert (p < 0.2).mean() >= 0.1


@pytest.mark.slow  # a statistical simulation: seconds on two cores
def test_repetitive_null_text_stays_calibrated(key: WatermarkKey) -> None:
    """Low-entropy text (Zipf over 300 ids) repeats triples; deduplication keeps the null exact."""
    rng = np.random.default_rng(72)
    weights = 1.0 / np.arange(1, 301) ** 1.1
    weights /= weights.sum()
    n = 800
    results = [decode(rng.choice(300, 402, p=weights), key) for _ in range(n)]
    assert np.mean([r.scored_tokens for r in results]) < 395  # repeats were dropped
    p = np.array([detect(r).p_value for r in results])
    for alpha in (0.01, 0.05, 0.2):
        assert (p < alpha).mean() <= alpha + _band(alpha, n), (alpha, (p < alpha).mean())


def test_attribution_null_per_candidate_hits_are_binomial(key: WatermarkKey) -> None:
    """H_m for a fixed candidate on null text ~ Binomial(trials, q0), the model behind attribution's p-value."""
    rng = np.random.default_rng(73)
    (m,) = random_messages(key.params, 1, seed=74)
    cs = CandidateSet([m.bits], ["m"], key.params)
    q0 = 1 - 0.75**2
    hits = np.array([cs.hits(decode(rng.integers(0, VOCAB, LENGTH + 2), key).matrix)[0] for _ in range(1500)])
    edges = np.arange(0, LENGTH + 2)
    expected = stats.binom.pmf(edges[:-1], LENGTH, q0) * hits.size
    observed = np.bincount(hits, minlength=LENGTH + 1)[: LENGTH + 1]
    # pool the tails so every cell expects >= 5
    lo, hi = np.nonzero(expected >= 5)[0][[0, -1]]
    exp_cells = np.concatenate([[expected[: lo + 1].sum()], expected[lo + 1 : hi], [expected[hi:].sum()]])
    obs_cells = np.concatenate([[observed[: lo + 1].sum()], observed[lo + 1 : hi], [observed[hi:].sum()]])
    exp_cells *= obs_cells.sum() / exp_cells.sum()
    assert stats.chisquare(obs_cells, exp_cells).pvalue > 1e-4


@pytest.fixture(scope="module")
def watermarked(key: WatermarkKey):
    messages = random_messages(key.params, 8, seed=75)
    return messages, generate(key, messages, 300, seed=76).tokens


def test_watermarked_text_is_detected_with_a_tiny_p_value(key: WatermarkKey, watermarked) -> None:
    _, tokens = watermarked
    for row in tokens:
        d = detect(decode(row, key))
        assert d.is_watermarked and d.p_value <= 1e-4 and d.statistic > 0
        assert d.statistic_name == "min_shard_deficit"
        assert d.sigma_p_value < 1e-3
        r = decode(row, key)
        assert d.sigma == pytest.approx(float(r.matrix.std(axis=1).mean()))


def test_text_decoded_with_another_secret_is_not_watermarked(key: WatermarkKey, watermarked) -> None:
    messages, tokens = watermarked
    other = WatermarkKey.from_secret(OTHER_SECRET, key.params)
    cands = CandidateSet([m.bits for m in messages], list(range(len(messages))), key.params)
    for row in tokens:
        r = decode(row, other)
        d = detect(r)
        assert not d.is_watermarked and d.p_value >= 1e-3
        a = attribute(r, cands)
        assert a.best is None and a.p_value >= 1e-3
    # the right key on the same texts names them
    assert all(attribute(decode(row, key), cands).best.id == i for i, row in enumerate(tokens))


def test_detect_options_and_degenerate_input(key: WatermarkKey) -> None:
    r = decode([1, 2, 3, 4, 5], key)
    for alpha in (0.0, 1.0, -0.1, 2.0):
        with pytest.raises(ValueError, match="alpha"):
            detect(r, alpha=alpha)
    nothing = decode([1, 2, 3], key, skip_ids=[3])  # every token skipped
    assert nothing.scored_tokens == 0
    d = detect(nothing)
    assert not d.is_watermarked and d.p_value == 1.0
