"""The naming rule (xmark_core.naming), which every decoder asks: its order, its levels and their checks."""

from __future__ import annotations

import numpy as np
import pytest

from xmark_core import DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, CandidateSet, Multiplicity, NamingRule, WatermarkParams
from xmark_core.naming import check_ranking, corrected


def test_each_rule_must_hold_to_name() -> None:
    rule = NamingRule()
    assert (rule.alpha, rule.min_confidence, rule.identity_level) == (DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, None)
    assert rule.evidence_names(1e-4, 2.0, 0.995)
    assert not rule.evidence_names(DEFAULT_ALPHA, 2.0, 0.995)  # p must be below alpha, not at it
    assert not rule.evidence_names(1e-4, 0.0, 0.995)  # an exact tie names nobody
    assert not rule.evidence_names(1e-4, -1.0, 0.995)
    assert not rule.evidence_names(1e-4, 2.0, 0.98)
    assert rule.evidence_names(1e-4, 2.0, DEFAULT_MIN_CONFIDENCE)  # at the confidence level is enough


def test_the_identity_level_is_the_callers_or_alpha_where_the_decoder_always_tests() -> None:
    assert NamingRule().identity_bound(always=False) is None
    assert NamingRule().identity_bound(always=True) == DEFAULT_ALPHA
    assert NamingRule(identity_level=0.01).identity_bound(always=False) == 0.01
    # the gumbel decoders always test identity: at alpha, or at the caller's level where stricter
    assert NamingRule(identity_level=0.01).identity_bound(always=True) == DEFAULT_ALPHA
    assert NamingRule(identity_level=1e-5).identity_bound(always=True) == 1e-5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"identity_level": 0.0}, "identity_level must be in"),
        ({"identity_level": 1.0}, "identity_level must be in"),
        ({"min_confidence": -0.1}, "min_confidence must be in"),
        ({"min_confidence": 1.5}, "min_confidence must be in"),
    ],
)
def test_levels_out_of_range_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NamingRule(**kwargs)


def test_the_ranking_needs_one_candidate_and_a_multiplicity() -> None:
    assert check_ranking(1, None) == Multiplicity()  # the decoder's own test alone
    given = Multiplicity(candidate_sets=2)
    assert check_ranking(3, given) is given
    with pytest.raises(ValueError, match="top must be >= 1"):
        check_ranking(0, None)
    with pytest.raises(TypeError, match="multiplicity must be a Multiplicity"):
        check_ranking(1, 4)  # type: ignore[arg-type]  # a bare count is not a multiplicity


@pytest.mark.parametrize(
    "kwargs",
    [{"candidate_sets": 0}, {"reading_tests": 0}, {"encoders": ()}, {"encoders": (2, 0)}, {"candidate_sets": True}],
)
def test_a_multiplicity_counts_at_least_one_test_of_each_kind(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be integers >= 1"):
        Multiplicity(**kwargs)  # type: ignore[arg-type]


def test_the_multiplicity_is_the_product_of_every_factor() -> None:
    """Tries: candidate sets x key readings (each version's encoders) x each reading's tests; a
    detection p-value also counts the salts, a candidate's the candidate set's size or share."""
    m = Multiplicity(candidate_sets=2, encoders=(2, 1, 2), reading_tests=3)
    assert (m.key_readings, m.tries) == (5, 2 * 5 * 3)
    assert Multiplicity.of_tries(7).tries == 7 and Multiplicity().tries == 1
    biasing = WatermarkParams(bits=8, block_bits=2)
    salted = WatermarkParams(bits=8, block_bits=4, num_keys=1, scheme="gumbel", salts=16)
    assert m.detection_factor(biasing) == 30.0 and m.detection_factor(salted) == 30.0 * 16
    registry = CandidateSet(["00000000", "01010101", "11110000", "00001111"], [1, 2, 3, 4], salted)
    np.testing.assert_array_equal(m.naming_factors(registry, [2, 0], salted), [30.0 * 16 * 4] * 2)
    shared = registry.with_shares([0.5, 0.25, 0.125, 0.125])
    np.testing.assert_array_equal(m.naming_factors(shared, [1, 0], salted), [30.0 * 16 * 4, 30.0 * 16 * 2])
    np.testing.assert_array_equal(corrected(np.array([1e-4, 0.5]), np.array([100.0, 100.0])), [1e-2, 1.0])
    m.check_readings(30)
    with pytest.raises(ValueError, match="less than the 31 key readings"):
        m.check_readings(31)
