"""The naming policy: one object the settings fill, its rules as docs/service.md lists them, and
its variants reaching the decoders (no patch of the code)."""

from __future__ import annotations

import re
from dataclasses import fields, replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.config import Settings
from service.provenance.retrieval import Lead
from service.trace.policy import RULES, CopyBar, TracePolicy, policy_table
from tests.core.synthetic import generate, random_messages
from tests.core.test_likelihood import scores_of
from xmark_core import CandidateSet, NamingRule, WatermarkKey, WatermarkParams, score_text
from xmark_core.likelihood import attribute_likelihood
from xmark_core.naming import rule_of

DOCS = Path(__file__).resolve().parents[3] / "docs" / "service.md"


def test_docs_service_md_lists_the_policy_the_code_applies() -> None:
    text = DOCS.read_text(encoding="utf-8")
    found = re.search(r"<!-- naming-policy:start -->\n(.*?)<!-- naming-policy:end -->", text, re.S)
    assert found, "docs/service.md has no naming-policy table"
    assert found.group(1) == policy_table(), "regenerate the table: python -c 'from service.trace.policy import ...'"


def test_every_threshold_is_named_by_a_rule_and_the_rules_are_in_order() -> None:
    names = {f.name for f in fields(TracePolicy)}
    named = {t for rule in RULES for t in rule.thresholds}
    assert named <= names
    # the reading's parameters are not naming thresholds; every other field belongs to a rule
    reading = {"temperature", "edit_rate", "top_k", "likelihood_max_tokens", "match_similarity"}
    assert names - named == reading
    assert [rule.order for rule in RULES] == list(range(1, len(RULES) + 1))


def test_the_settings_fill_the_policy_and_its_defaults_are_the_settings_defaults() -> None:
    assert TracePolicy.from_settings(Settings()) == TracePolicy()
    tuned = Settings(
        trace_alpha=1e-4,
        trace_identity_level=0.005,
        provenance_lead_similarity=0.2,
        provenance_leads=7,
        provenance_match_similarity=0.5,
        trace_temperature=0.9,
        trace_edit_rate=0.05,
        trace_top_k=10,
        trace_likelihood_max_tokens=512,
    )
    policy = TracePolicy.from_settings(tuned)
    assert (policy.alpha, policy.identity_level, policy.lead_similarity, policy.max_leads) == (1e-4, 0.005, 0.2, 7)
    assert (policy.match_similarity, policy.temperature, policy.edit_rate, policy.top_k) == (0.5, 0.9, 0.05, 10)
    assert policy.likelihood_max_tokens == 512
    assert policy.naming_rule() == NamingRule(alpha=1e-4, identity_level=0.005)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"lead_identity_level": 1.5}, "lead_identity_level"),
        ({"top_lead_share": 0.0}, "top_lead_share"),
        ({"max_leads": -1}, "max_leads"),
        ({"identity_level": 0.0}, "identity_level"),
        ({"min_confidence": 1.5}, "min_confidence"),
    ],
)
def test_an_impossible_threshold_is_refused(change: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TracePolicy(**change)  # type: ignore[arg-type]


def _lead(user: int, similarity: float, shingles: float) -> Lead:
    return Lead(user * 10, user, f"req-{user}", datetime(2026, 1, 1, tzinfo=UTC), "m", similarity, shingles)


def test_the_leads_rules_read_the_policy_s_thresholds() -> None:
    leads = [_lead(3, 0.95, 0.3), _lead(4, 0.5, 0.1), _lead(3, 0.4, 0.0), _lead(5, 0.05, 0.0)]
    assert TracePolicy().lead_users(leads) == [3, 4]  # 0.1 and more, each user once
    assert TracePolicy(lead_similarity=0.45).lead_users(leads) == [3, 4]
    assert TracePolicy(lead_similarity=0.6).lead_users(leads) == [3]
    assert TracePolicy(max_leads=1).lead_users(leads) == [3]
    assert TracePolicy().copy_holder(leads) == 3
    stricter = CopyBar(0.99, 0.25)
    assert TracePolicy(near_copy=stricter).copy_holder(leads) == 3  # no near-copy, still an edited copy
    assert TracePolicy(near_copy=stricter, edited_copy=CopyBar(0.96, 0.15)).copy_holder(leads) is None
    assert TracePolicy(near_copy=stricter, edited_copy=CopyBar(0.5, 0.1)).copy_holder(leads) is None  # two holders
    assert TracePolicy().lead_identity_stands(None) and TracePolicy().lead_identity_stands(0.01)
    assert not TracePolicy().lead_identity_stands(0.011)
    assert TracePolicy().registry_backs(True, 0.99) and not TracePolicy().registry_backs(True, 0.98)
    assert not TracePolicy().registry_backs(False, 1.0)


def test_the_lone_candidate_margin_is_a_policy_variant_the_decoder_applies() -> None:
    """Texts carrying another message than the lone candidate's (seeded synthetic model): the
    product's policy names the candidate only where its log-likelihood ratio is positive; the
    variant that lets the p-value alone decide (the provenance ceiling's bound) names it wherever
    the p-value passes, whatever the ratio."""
    params = WatermarkParams(bits=32, block_bits=2, num_keys=2)
    key = WatermarkKey.from_secret("policy-test-secret-0123456789abcdef", params)
    lone, other = random_messages(params, 2, seed=11)
    candidates = CandidateSet([lone.bits], [1], params)
    generation = generate(key, [other] * 12, 40, top_k=20, seed=5, temperature=1.0)
    product = TracePolicy(alpha=0.999)  # a level every p-value below 1 passes: the margin decides
    variant = replace(product, lone_candidate_margin=False)
    negative = 0
    for row in range(12):
        ids = [int(t) for t in generation.tokens[row]]
        result = score_text(ids, scores_of(generation, row), key, temperature=1.0)
        kept = attribute_likelihood(result, candidates, rule=product.naming_rule())
        bound = attribute_likelihood(result, candidates, rule=variant.naming_rule())
        assert (kept.best is not None) == (kept.margin > 0 and kept.p_value < 0.999), row
        assert (bound.best is not None) == (bound.p_value < 0.999), row
        negative += kept.margin <= 0 and bound.best is not None
    assert negative >= 1  # seeded: the rule withdrew at least one naming the variant keeps


def test_a_decoder_takes_its_levels_from_the_rule_or_the_arguments_not_both() -> None:
    assert rule_of(None, 0.01, 0.9, 0.05) == NamingRule(0.01, 0.9, 0.05)
    rule = NamingRule(lone_candidate_margin=False)
    assert rule_of(rule, NamingRule().alpha, NamingRule().min_confidence, None) is rule
    with pytest.raises(ValueError, match="not both"):
        rule_of(rule, 0.01, 0.99, None)
