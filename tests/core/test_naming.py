"""The naming rule (xmark_core.naming), which every decoder asks: its order, its levels and their checks."""

from __future__ import annotations

import pytest

from xmark_core import DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, NamingRule
from xmark_core.naming import check_ranking


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


def test_the_ranking_needs_one_candidate_and_one_try() -> None:
    check_ranking(1, 1)
    for top, tries in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="top and tries must be >= 1"):
            check_ranking(top, tries)
